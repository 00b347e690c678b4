"""`python -m pdkv.bench router [--rate 6] [--requests 60] [--max-tokens 64]` — the router in front
of three colocated nodes against one node alone, at the same offered load.

The router is a ``pdkv router`` process and each node a real ``pdkv serve`` process (so the three do not share one GIL), torch at one
thread each (OMP_NUM_THREADS=1), on a seeded Llama built with pdkv.tiny_model (hidden 256, 4
layers). The load is the same sequence of requests with Poisson arrivals at ``--rate`` per
second, streamed; the client times every SSE chunk. The one node is also measured without
the router (the router's own cost). Reported: output tokens/s over the run,
TTFT p50/p99 and inter-token latency (ITL) p50/p99, and the ratios 3-nodes / 1-node.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import aiohttp

ROOT = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start_nodes(model: Path, n: int, workdir: Path) -> list[tuple[subprocess.Popen, str]]:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    out = []
    for i in range(n):
        port = _free_port()
        log = open(workdir / f"node{i}.log", "w")
        p = subprocess.Popen([sys.executable, "-m", "pdkv", "serve", "--set", f"model.path={model}", "--set",
                              f"server.port={port}", "--set", "kv_cache.num_pages=1024", "--log-level", "warning"],
                             cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
        out.append((p, f"http://127.0.0.1:{port}"))
    for p, url in out:
        end = time.monotonic() + 180
        while True:
            if p.poll() is not None:
                raise RuntimeError(f"node {url} exited: see {workdir}")
            try:
                urllib.request.urlopen(url + "/health", timeout=2)
                break
            except OSError:
                if time.monotonic() > end:
                    raise RuntimeError(f"node {url} not healthy")
                time.sleep(0.3)
    return out


def _wait_router(url: str, n: int) -> None:
    end = time.monotonic() + 60
    while time.monotonic() < end:
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if json.loads(r.read())["num_healthy"] == n:
                    return
        except OSError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"router {url} did not see {n} healthy nodes")


def _stop(nodes) -> None:
    for p, _ in nodes:
        p.terminate()
    for p, _ in nodes:
        try:
            p.wait(30)
        except subprocess.TimeoutExpired:
            p.kill()


async def _load(url: str, prompts: list[str], gaps: list[float], max_tokens: int) -> dict:
    ttft, itl, tokens = [], [], 0

    async def one(s: aiohttp.ClientSession, prompt: str) -> None:
        nonlocal tokens
        t0 = time.perf_counter()
        last = None
        body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True}
        async with s.post(url + "/v1/completions", json=body) as r:
            assert r.status == 200, await r.text()
            async for line in r.content:
                if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                    continue
                now = time.perf_counter()
                ev = json.loads(line[6:])
                if "error" in ev:
                    raise RuntimeError(ev)
                tokens += 1  # one event per token while the client keeps up
                if last is None:
                    ttft.append(now - t0)
                else:
                    itl.append(now - last)
                last = now

    start = time.perf_counter()
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as s:
        tasks = []
        for prompt, gap in zip(prompts, gaps):
            await asyncio.sleep(gap)
            tasks.append(asyncio.create_task(one(s, prompt)))
        await asyncio.gather(*tasks)
    wall = time.perf_counter() - start

    def pct(xs, q):
        xs = sorted(xs)
        return xs[min(len(xs) - 1, int(q * len(xs)))] * 1000

    return {"tokens_per_s": tokens / wall, "wall_s": wall, "ttft_p50_ms": pct(ttft, 0.5), "ttft_p99_ms": pct(ttft, 0.99),
            "itl_p50_ms": pct(itl, 0.5), "itl_p99_ms": pct(itl, 0.99)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m pdkv.bench router")
    ap.add_argument("--rate", type=float, default=6.0, help="requests per second (Poisson)")
    ap.add_argument("--requests", type=int, default=60)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--json", default=None, help="write the results here")
    args = ap.parse_args(argv)
    from pdkv.tiny_model import make_tiny_model

    rng = random.Random(0)
    words = "casa sole mare vento pane vino strada monte fiume notte".split()
    prompts = [" ".join(rng.choice(words) for _ in range(rng.randint(20, 120))) for _ in range(args.requests)]
    gaps = [rng.expovariate(args.rate) for _ in prompts]
    results = {}
    with tempfile.TemporaryDirectory(prefix="pdkv-bench-router-") as tmp:
        model = make_tiny_model(Path(tmp) / "model", hidden_size=256, num_layers=4, num_heads=8, num_kv_heads=2,
                                max_position_embeddings=1024, seed=0)
        for n in (1, 3):
            nodes = _start_nodes(model, n, Path(tmp))
            try:
                rport = _free_port()
                router = subprocess.Popen([sys.executable, "-m", "pdkv", "router", "--set", f"port={rport}", "--set",
                                           f"nodes=[{', '.join(u for _, u in nodes)}]", "--log-level", "warning"],
                                          cwd=ROOT, env=dict(os.environ, OMP_NUM_THREADS="1"))
                nodes.append((router, f"http://127.0.0.1:{rport}"))  # stopped with them
                if n == 1:  # the router's own cost: the same load straight to the node
                    asyncio.run(_load(nodes[0][1], prompts[:6], [0.0] * 6, 4))  # warm-up
                    results["1_node_direct"] = r = asyncio.run(_load(nodes[0][1], prompts, gaps, args.max_tokens))
                    print(f"1 node, no router: {r['tokens_per_s']:.0f} tok/s, TTFT p50/p99 {r['ttft_p50_ms']:.0f}/"
                          f"{r['ttft_p99_ms']:.0f} ms, ITL p50/p99 {r['itl_p50_ms']:.1f}/{r['itl_p99_ms']:.1f} ms",
                          flush=True)
                url = nodes[-1][1]
                _wait_router(url, n)
                asyncio.run(_load(url, prompts[:6], [0.0] * 6, 4))  # warm-up
                results[f"{n}_nodes"] = asyncio.run(_load(url, prompts, gaps, args.max_tokens))
            finally:
                _stop(nodes)
            r = results[f"{n}_nodes"]
            print(f"{n} node(s) behind the router: {r['tokens_per_s']:.0f} tok/s, TTFT p50/p99 "
                  f"{r['ttft_p50_ms']:.0f}/{r['ttft_p99_ms']:.0f} ms, ITL p50/p99 {r['itl_p50_ms']:.1f}/"
                  f"{r['itl_p99_ms']:.1f} ms (wall {r['wall_s']:.1f} s)", flush=True)
    a, b = results["1_nodes"], results["3_nodes"]
    results["ratios"] = {"throughput_3_over_1": b["tokens_per_s"] / a["tokens_per_s"],
                         "itl_p99_3_over_1": b["itl_p99_ms"] / a["itl_p99_ms"],
                         "ttft_p99_3_over_1": b["ttft_p99_ms"] / a["ttft_p99_ms"],
                         "router_over_direct_itl_p99": a["itl_p99_ms"] / results["1_node_direct"]["itl_p99_ms"],
                         "router_over_direct_throughput": a["tokens_per_s"] / results["1_node_direct"]["tokens_per_s"]}
    print("ratios 3 nodes / 1 node:", {k: round(v, 2) for k, v in results["ratios"].items()})
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0
