"""The HTTP path of `python -m pdkv.bench interference --http`: the decode-stall probe, as a
user runs it.

Per configuration it starts ``pdkv serve -c configs/colocated.yaml`` (the embedded default model)
with ``scheduler.chunk_size`` / ``scheduler.max_num_batched_tokens`` set, opens ``streams``
streaming /v1/completions (24-token prompts, 160 tokens, ``ignore_eos``), sends ``num_long``
long prompts ``gap_s`` seconds apart while they run, and takes ITL from the arrival times of the
streams' SSE chunks and TTFT from each long prompt's first chunk. Everything stays on 127.0.0.1.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import torch

from pdkv.bench._steps import percentile


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_healthy(port: int, proc: subprocess.Popen, timeout: float = 300.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"pdkv serve exited with {proc.returncode} before it was healthy")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2):
                return
        except OSError:
            time.sleep(0.5)
    raise TimeoutError(f"pdkv serve on port {port} not healthy after {timeout:.0f} s")


async def _stream(session, port: int, prompt: list[int], max_tokens: int) -> tuple[float, list[float]]:
    """Sends one streaming completion; returns (send time, arrival time of each token chunk)."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True,
            "return_token_ids": True}  # a chunk per token even when its text is still incomplete UTF-8
    sent, times = time.perf_counter(), []
    async with session.post(f"http://127.0.0.1:{port}/v1/completions", json=body) as r:
        if r.status != 200:
            raise RuntimeError(f"HTTP {r.status}: {await r.text()}")
        async for line in r.content:
            line = line.strip()
            if line.startswith(b"data: ") and line != b"data: [DONE]":
                choices = json.loads(line[6:])["choices"]
                if choices and choices[0].get("token_ids"):
                    times.append(time.perf_counter())
    return sent, times


async def _probe(port: int, streams: list[list[int]], prompts: list[list[int]], gap_s: float,
                 stream_tokens: int, long_tokens: int) -> dict:
    import aiohttp

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
        tasks = [asyncio.create_task(_stream(session, port, s, stream_tokens)) for s in streams]
        longs = []
        for i, p in enumerate(prompts):
            if i:
                await asyncio.sleep(gap_s)
            longs.append(asyncio.create_task(_stream(session, port, p, long_tokens)))
        done = await asyncio.gather(*tasks, *longs)
    itl = [(b - a) * 1e3 for _, ts in done[:len(streams)] for a, b in zip(ts, ts[1:])]
    ttft = [(ts[0] - sent) * 1e3 for sent, ts in done[len(streams):] if ts]
    return {"itl": itl, "ttft": ttft}


def run_http(chunk: int, budget: int, streams, prompts, gap_s: float, stream_tokens: int,
             long_tokens: int, threads: int) -> dict:
    port = _free_port()
    config = Path(__file__).resolve().parents[2] / "configs" / "colocated.yaml"
    cmd = [sys.executable, "-m", "pdkv", "serve", "-c", str(config), "--log-level", "warning",
           "--set", f"server.port={port}", "--set", f"scheduler.chunk_size={chunk}",
           "--set", f"scheduler.max_num_batched_tokens={budget}"]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        _wait_healthy(port, proc)
        return asyncio.run(_probe(port, streams, prompts, gap_s, stream_tokens, long_tokens))
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _median_of(runs: list[dict], key: str) -> float:
    return statistics.median(x[key] for x in runs)


def main_http(a) -> int:
    from pdkv.default_model import SPEC

    gap = a.arrival_gap_s or 1.5
    context = SPEC["max_position_embeddings"]
    lens = [n for n in (int(x) for x in a.prompt_lens.split(",")) if n + a.long_new_tokens <= context]
    gen = torch.Generator().manual_seed(0)
    V = SPEC["vocab_size"]
    streams = [torch.randint(0, V, (a.stream_prompt,), generator=gen).tolist() for _ in range(a.streams)]
    prompts = {n: [torch.randint(0, V, (n,), generator=gen).tolist() for _ in range(a.num_long)] for n in lens}
    chunks = a.chunks.split(",")
    print(f"HTTP probe: pdkv serve -c configs/colocated.yaml per configuration, {a.streams} SSE streams x "
          f"{a.stream_tokens} tokens, {a.num_long} long prompts {gap} s apart, OMP threads {a.threads}, "
          f"load average {os.getloadavg()[0]:.1f}", flush=True)
    runs: dict[tuple[int, str], list[dict]] = {}
    for rep in range(a.repeats):
        for n in lens:
            for c in chunks:
                chunk = context if c == "whole" else int(c)
                budget = chunk + a.streams + a.num_long if a.budget == "chunk" else int(a.budget)
                r = run_http(chunk, budget, streams, prompts[n], gap, a.stream_tokens, a.long_new_tokens,
                             a.threads)
                runs.setdefault((n, c), []).append({
                    "itl_p50": percentile(r["itl"], 50), "itl_p99": percentile(r["itl"], 99),
                    "itl_max": max(r["itl"]), "ttft_mean": statistics.mean(r["ttft"])})
            print(f"repeat {rep + 1}/{a.repeats} P={n} done (load average {os.getloadavg()[0]:.1f})", flush=True)
    table = []
    for n in lens:
        print(f"\nP={n} (median of {a.repeats} runs; ms)\n  chunk | ITL p50   p99    max | TTFT mean  x1st")
        base = _median_of(runs[(n, chunks[0])], "ttft_mean")
        for c in chunks:
            row = {"prompt_len": n, "chunk": c, **{k: _median_of(runs[(n, c)], k)
                                                 for k in ("itl_p50", "itl_p99", "itl_max", "ttft_mean")}}
            table.append(row)
            print(f"  {c:>5} | {row['itl_p50']:6.1f} {row['itl_p99']:6.1f} {row['itl_max']:6.1f} "
                  f"| {row['ttft_mean']:8.0f} {row['ttft_mean'] / base:5.2f}")
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"bench": "interference-http", "args": vars(a), "results": table}, indent=2))
    print(f"wrote {out}")
    return 0
