"""`python -m pdkv.bench where`: where should a decode node prefill a prompt? Time to first
token of a prompt prefilled on the decode node itself against one sent to a prefill node, by
prompt length, in the same run; and the prefill node's throughput, which turns a queue bound
(disagg.max_prefill_queue_tokens) into seconds of waiting.

One prefill node and two decode nodes run in this process (real HTTP, real control channel, real
tcp transport): decode node L prefills everything itself (disagg.max_prefill_queue_tokens 0),
decode node R sends every multi-token prompt to the prefill node (local_prefill_max_tokens 0).
Each length gets ``--repeats`` fresh random prompts (prefix caching off), each sent to L and to R
in alternating order, max_tokens 1; the request time is the TTFT. The crossover (the longest
length where local is still no slower) is what disagg.local_prefill_max_tokens is picked from.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
import urllib.request
from pathlib import Path

import numpy as np


def _post(url: str, name: str, prompt: list[int]) -> float:
    body = json.dumps({"model": name, "prompt": prompt, "max_tokens": 1, "temperature": 0}).encode()
    t = time.perf_counter()
    urllib.request.urlopen(urllib.request.Request(url + "/v1/completions", body,
                                                  {"Content-Type": "application/json"}), timeout=600).read()
    return time.perf_counter() - t


def run(model: str, lengths: list[int], repeats: int, page_size: int, threads: int) -> dict:
    from pdkv.config import config_from_dict
    from pdkv.disagg.node import build_node, kv_buffer_factory
    from pdkv.engine import LLMEngine
    from pdkv.server.app import NODE
    from pdkv.server.runner import ServerThread

    top = max(lengths)

    def cfg(role, messenger=None, disagg=None):
        return config_from_dict({"role": role, "model": {"path": model},
                                 "kv_cache": {"page_size": page_size, "num_pages": 4 * top // page_size + 16,
                                              "prefix_caching": False},
                                 "scheduler": {"max_num_batched_tokens": 2048, "chunk_size": 512, "max_num_seqs": 4},
                                 "server": {"port": 0}, "messenger": messenger or {}, "disagg": disagg or {}})

    def engine(c):
        return LLMEngine.from_config(c, kv_buffer=kv_buffer_factory("cpu"), num_threads=threads)

    pc = cfg("prefill")
    pe = engine(pc)
    vocab = pe.vocab_size
    rng = np.random.default_rng(0)
    out: dict = {}
    with ServerThread(pc, pe, build_node(pc, pe)) as pre:
        peers = {"prefill_peers": [f"127.0.0.1:{pre.app[NODE].control_port}"], "transfer_timeout_s": 600.0}
        lc = cfg("decode", peers, {"max_prefill_queue_tokens": 0})
        rc = cfg("decode", peers, {"local_prefill_max_tokens": 0})
        le, re_ = engine(lc), engine(rc)
        with ServerThread(lc, le, build_node(lc, le)) as loc, ServerThread(rc, re_, build_node(rc, re_)) as rem:
            name = json.loads(urllib.request.urlopen(loc.url + "/v1/models").read())["data"][0]["id"]
            for url in (loc.url, rem.url):  # warm-up
                _post(url, name, rng.integers(3, vocab, 64).tolist())
            for n in lengths:
                times = {"local": [], "remote": []}
                for r in range(repeats):
                    prompt = rng.integers(3, vocab, n).tolist()
                    order = [("local", loc.url), ("remote", rem.url)]
                    for kind, url in order if r % 2 == 0 else order[::-1]:
                        times[kind].append(_post(url, name, prompt))
                out[n] = {k: 1e3 * statistics.median(v) for k, v in times.items()}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="", help="HF folder (default: the shipped default model; "
                                                "'50m': the seeded ~50M Llama of pdkv.bench engine)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--threads", type=int, default=1, help="torch threads per engine")
    ap.add_argument("--lengths", default="4,8,16,32,64,128,256,512,1024")
    a = ap.parse_args(argv)
    tmp = None
    if a.model == "":
        from pdkv.default_model import default_model_dir

        a.model = str(default_model_dir())
    elif a.model == "50m":
        from pdkv.tiny_model import make_tiny_model

        tmp = tempfile.TemporaryDirectory(prefix="pdkv-bench-")
        a.model = str(make_tiny_model(Path(tmp.name) / "bench-50m", hidden_size=512, num_layers=8, num_heads=8,
                                      num_kv_heads=2, intermediate_size=1536, vocab_size=32000,
                                      max_position_embeddings=4096, seed=0))
    lengths = [int(x) for x in a.lengths.split(",")]
    res = run(a.model, lengths, a.repeats, a.page_size, a.threads)
    print(f"where bench: {Path(a.model).name}, page {a.page_size}, tcp loopback, median TTFT of {a.repeats} "
          f"(max_tokens 1), local and remote alternating in the same run")
    print(f"{'prompt':>7} {'local ms':>9} {'remote ms':>10} {'remote/local':>13} {'remote tok/s':>13}")
    for n, r in res.items():
        print(f"{n:>7} {r['local']:>9.1f} {r['remote']:>10.1f} {r['remote'] / r['local']:>13.2f} "
              f"{n / (r['remote'] / 1e3):>13.0f}")
    faster = [n for n, r in res.items() if r["local"] <= r["remote"]]
    print(f"local no slower up to: {max(faster) if faster else 'none'} tokens "
          f"(lengths where local <= remote: {faster})")
    if tmp is not None:
        tmp.cleanup()
    return 0
