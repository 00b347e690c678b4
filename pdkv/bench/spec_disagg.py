"""`python -m pdkv.bench spec_disagg`: speculative decoding on a disaggregated decode node, over
the real API: one prefill node feeding two decode nodes on loopback (tcp, in-process), one
plain and one speculative (``--method ngram``, or mtp / draft with the prefill node handing the
proposer's KV off, which then feeds a third, plain decode node of its own). The same prompts go
to both decode nodes, interleaved, one batch at a time (``--batch-sizes``, concurrent
streaming clients).

Per request, from the SSE stream: time to the first token, decode tokens/s after it
((n - 1) / (t_last - t_first)), and how many tokens the first decode step delivered (> 1: the
decode node verified drafts from its first step, without any local prefill). Greedy outputs of
the two nodes are checked equal. Workload as `bench spec`: random prompts P with P's own greedy
output O[:m] appended, so the continuation repeats spans of the prompt.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import time
from pathlib import Path


def _node_cfg(model: str, role: str, spec: dict | None, pages: int, peers=()):
    from pdkv.config import config_from_dict

    d = {"role": role, "model": {"path": model}, "kv_cache": {"page_size": 16, "num_pages": pages,
                                                              "prefix_caching": False},
         "scheduler": {"max_num_batched_tokens": 4096, "chunk_size": 1024, "max_num_seqs": 16},
         "server": {"port": 0}, "messenger": {"transfer_timeout_s": 60.0, "prefill_peers": list(peers)}}
    if spec:
        d["speculative"] = spec
    return config_from_dict(d)


def _start(cfg, threads: int):
    from pdkv.disagg.node import build_node, kv_buffer_factory
    from pdkv.engine import LLMEngine
    from pdkv.server.runner import ServerThread

    eng = LLMEngine.from_config(cfg, kv_buffer=kv_buffer_factory("cpu"), num_threads=threads)
    return eng, ServerThread(cfg, eng, build_node(cfg, eng)).start()


async def _stream(session, url: str, name: str, prompt: list[int], n: int) -> dict:
    body = {"model": name, "prompt": prompt, "max_tokens": n, "temperature": 0, "ignore_eos": True,
            "stream": True, "return_token_ids": True}
    t0, times, chunks = time.perf_counter(), [], []
    async with session.post(url + "/v1/completions", json=body) as resp:
        assert resp.status == 200, await resp.text()
        async for line in resp.content:
            if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
                continue
            ids = json.loads(line[6:])["choices"][0].get("token_ids") or []
            if ids:
                times.append(time.perf_counter())
                chunks.append(list(ids))
    tokens = [t for c in chunks for t in c]
    decode_s = times[-1] - times[0]
    return {"tokens": tokens, "ttft_s": times[0] - t0, "first_step_tokens": len(chunks[0]),
            "decode_tok_s": (len(tokens) - len(chunks[0])) / decode_s if decode_s > 0 else float("nan")}


async def _batch(url: str, name: str, prompts: list[list[int]], n: int) -> list[dict]:
    import aiohttp

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as s:
        return await asyncio.gather(*(_stream(s, url, name, p, n) for p in prompts))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m pdkv.bench spec_disagg", description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="a model folder (default: the tests' tiny looping Llama)")
    ap.add_argument("--method", default="ngram", choices=["ngram", "draft", "mtp"])
    ap.add_argument("--num-tokens", type=int, default=4)
    ap.add_argument("--batch-sizes", default="1,8")
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--prefix-tokens", type=int, default=96)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=2, help="rounds per batch size (both nodes each round)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per engine")
    ap.add_argument("--out", default="bench-results/spec_disagg.json")
    a = ap.parse_args(argv)

    import torch

    tmp = None
    if a.model is None:
        from pdkv.bench.spec import tiny_model

        a.model, tmp = tiny_model(a.method)
    sizes = [int(b) for b in a.batch_sizes.split(",")]
    total = a.prompt_len + a.prefix_tokens + a.new_tokens + a.num_tokens + 1
    pages = max(sizes) * (-(-total // 16)) + 16
    spec = {"method": a.method, "num_tokens": a.num_tokens,
            **({"draft_model": {"path": a.model}} if a.method == "draft" else {})}
    handoff = a.method != "ngram"  # mtp / draft: the prefill node prepares the proposer's KV
    nodes = []
    try:
        p_plain = _start(_node_cfg(a.model, "prefill", None, pages), a.threads)
        nodes.append(p_plain)
        from pdkv.server.app import NODE

        addr = lambda t: [f"127.0.0.1:{t.app[NODE].control_port}"]  # noqa: E731
        p_spec = p_plain
        if handoff:
            p_spec = _start(_node_cfg(a.model, "prefill", spec, pages), a.threads)
            nodes.append(p_spec)
        d_plain = _start(_node_cfg(a.model, "decode", None, pages, addr(p_plain[1])), a.threads)
        d_spec = _start(_node_cfg(a.model, "decode", spec, pages, addr(p_spec[1])), a.threads)
        nodes += [d_plain, d_spec]
        name = d_plain[0].model_name
        gen = torch.Generator().manual_seed(0)
        V = d_plain[0].vocab_size
        print(f"model {a.model}, method {a.method} k={a.num_tokens} on the decode node"
              f"{' (hand-off from its prefill node)' if handoff else ''}, {a.threads} thread(s) per engine, "
              f"load average {os.getloadavg()[0]:.1f}", flush=True)
        results = []
        for b in sizes:
            bases = [torch.randint(0, V, (a.prompt_len,), generator=gen).tolist() for _ in range(b)]
            outs = asyncio.run(_batch(d_plain[1].url, name, bases, a.prefix_tokens + a.new_tokens))
            prompts = [p + o["tokens"][:a.prefix_tokens] for p, o in zip(bases, outs)]
            rows = {"plain": [], "spec": []}
            d_spec[0].spec.stats.__init__(a.num_tokens)
            for _ in range(a.repeats):  # interleaved: both see the same machine load
                ref = asyncio.run(_batch(d_plain[1].url, name, prompts, a.new_tokens))
                got = asyncio.run(_batch(d_spec[1].url, name, prompts, a.new_tokens))
                assert [r["tokens"] for r in got] == [r["tokens"] for r in ref], "speculation changed greedy output"
                rows["plain"] += ref
                rows["spec"] += got
            st = d_spec[0].spec.stats
            med = {k: {m: statistics.median(r[m] for r in v) for m in ("ttft_s", "decode_tok_s", "first_step_tokens")}
                   for k, v in rows.items()}
            row = {"batch": b, **{f"{k}_{m}": x for k, d in med.items() for m, x in d.items()},
                   "decode_speedup": med["spec"]["decode_tok_s"] / med["plain"]["decode_tok_s"],
                   "acceptance_rate": st.acceptance_rate, "mean_accepted_length": st.mean_accepted_length}
            results.append(row)
            print(f"B={b:>2}  per-request decode tok/s (median): plain {med['plain']['decode_tok_s']:7.1f}  "
                  f"{a.method} {med['spec']['decode_tok_s']:7.1f}  speedup {row['decode_speedup']:.2f}x  "
                  f"TTFT {med['plain']['ttft_s'] * 1e3:.1f} / {med['spec']['ttft_s'] * 1e3:.1f} ms  "
                  f"tokens in the first decode step {med['plain']['first_step_tokens']:.0f} / "
                  f"{med['spec']['first_step_tokens']:.0f}  acceptance {st.acceptance_rate:.0%}  mean accepted "
                  f"length {st.mean_accepted_length:.2f}", flush=True)
        report = {"bench": "spec_disagg", "model": a.model, "method": a.method, "num_tokens": a.num_tokens,
                  "threads": a.threads, "load_average_1m": os.getloadavg()[0], "results": results}
        out = Path(a.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(report, indent=2))
        print(f"wrote {out}")
    finally:
        for eng, thread in reversed(nodes):
            thread.stop()
            eng.close()
        if tmp is not None:
            tmp.cleanup()
    return 0
