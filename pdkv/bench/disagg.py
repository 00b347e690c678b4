"""`python -m pdkv.bench disagg`: the exposed KV-transfer time of disaggregated prefill, layer-wise
streaming against sending after the forward pass, in the same run, on loopback tcp.

Model: the seeded ~50M Llama of `pdkv.bench engine` (hidden 512, 8 layers, 8 heads / 2 KV heads,
vocab 32000, float32). For each mode a prefill node and a decode node run in this process (real
HTTP, real control channel, real tcp transport); each prompt (512 and 2048 random tokens, one
prefill chunk) is sent ``--repeats`` times with max_tokens=1.

Exposed transfer = the decode node saw the last write of the request land (immediate count
complete) minus the end of the prefill node's forward pass (stamped in DONE_AT; same host
clock). The baseline measured in the same run: the time to move ONE layer of that prompt's
pages over the same transport (two messengers, write_pages, wait for the immediate count) -- the
floor layer-wise streaming aims at -- and ALL layers (what "after forward" must expose).
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


def _metric(url: str, name: str) -> float:
    text = urllib.request.urlopen(url + "/metrics").read().decode()
    vals = [float(x.split()[-1]) for x in text.splitlines() if x.startswith(name)]
    return vals[0] if vals else 0.0


def move_pages(num_pages: int, page_nbytes: int, num_layers: int, reps: int) -> float:
    """Median seconds to move num_pages pages of num_layers layers over tcp (two messengers)."""
    from pdkv._messenger import Messenger

    a, b = Messenger("tcp", 11), Messenger("tcp", 12)
    try:
        n = num_pages * page_nbytes * num_layers
        src, dst = np.random.default_rng(0).integers(0, 255, n, dtype=np.uint8), np.zeros(n, dtype=np.uint8)
        lkey, rkey = a.register(src), b.register(dst)
        b.grant(rkey, 12 - 1)
        ca, ia = a.prepare(12)
        cb, ib = b.prepare(11)
        a.complete(ca, ib)
        b.complete(cb, ia)
        pages = list(range(num_pages * num_layers))
        times = []
        for r in range(reps + 1):
            imm = 1000 + r
            b.expect(imm, len(pages))
            t = time.perf_counter()
            a.write_pages(ca, lkey, rkey, pages, pages, seg_len=page_nbytes, src_page_stride=page_nbytes,
                          dst_page_stride=page_nbytes, imm=imm)
            while not any(e.kind == "imm_done" for e in b.drain()):
                time.sleep(0.00005)
            times.append(time.perf_counter() - t)
            a.drain()
        return statistics.median(times[1:])
    finally:
        a.close()
        b.close()


def run_mode(model: str, layerwise: bool, prompts: dict, repeats: int, page_size: int,
             model_dtype: str = "float32", kv_dtype: str = "auto", max_tokens: int = 1,
             prefix_caching: bool = False, transport: str = "tcp", kv_handoff: str = "copy") -> dict:
    # NOTE: prefix caching is off by default: every repeat sends the same prompt, which the decode
    # node would find in its cache after the first, moving nothing (and timing nothing)
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests" / "disagg"))
    from pdkv.config import config_from_dict
    from pdkv.disagg.node import build_node, kv_buffer_factory
    from pdkv.engine import LLMEngine
    from pdkv.server.app import NODE
    from pdkv.server.runner import ServerThread

    def cfg(role, **m):
        return config_from_dict({"role": role, "model": {"path": model, "dtype": model_dtype},
                                 "kv_cache": {"page_size": page_size, "num_pages": 2 * 2048 // page_size + 8,
                                              "dtype": kv_dtype, "prefix_caching": prefix_caching},
                                 "scheduler": {"max_num_batched_tokens": 2048, "chunk_size": 2048, "max_num_seqs": 4},
                                 "server": {"port": 0}, "disagg": {"kv_handoff": kv_handoff},
                                 "messenger": {"layerwise": layerwise, "transport": transport, **m}})
    pc = cfg("prefill")
    pe = LLMEngine.from_config(pc, kv_buffer=kv_buffer_factory("cpu"))
    out = {}
    with ServerThread(pc, pe, build_node(pc, pe)) as pre:
        dc = cfg("decode", prefill_peers=[f"127.0.0.1:{pre.app[NODE].control_port}"], transfer_timeout_s=600.0)
        de = LLMEngine.from_config(dc, kv_buffer=kv_buffer_factory("cpu"))
        with ServerThread(dc, de, build_node(dc, de)) as dec:
            name = json.loads(urllib.request.urlopen(dec.url + "/v1/models").read())["data"][0]["id"]
            deadline = time.monotonic() + 30  # requests before the peer connects would prefill locally
            while time.monotonic() < deadline and not all(
                    p["connected"] for p in json.loads(urllib.request.urlopen(dec.url + "/health").read())
                    .get("prefill_peers", [{"connected": False}])):
                time.sleep(0.05)
            for plen, prompt in prompts.items():
                exposed, ttft, moved = [], [], []
                for _ in range(repeats + 1):  # the first is a warm-up
                    s0 = _metric(dec.url, "pdkv_kv_transfer_exposed_seconds_sum")
                    b0 = _metric(pre.url, "pdkv_kv_transfer_bytes_total")
                    body = json.dumps({"model": name, "prompt": prompt, "max_tokens": max_tokens}).encode()
                    t = time.perf_counter()
                    urllib.request.urlopen(urllib.request.Request(dec.url + "/v1/completions", body,
                                                                  {"Content-Type": "application/json"}), timeout=600).read()
                    ttft.append(time.perf_counter() - t)
                    time.sleep(0.05)  # DONE_AT may trail the response
                    exposed.append(_metric(dec.url, "pdkv_kv_transfer_exposed_seconds_sum") - s0)
                    moved.append(_metric(pre.url, "pdkv_kv_transfer_bytes_total") - b0)
                out[plen] = {"exposed_ms": 1e3 * statistics.median(exposed[1:]),
                             "request_ms": 1e3 * statistics.median(ttft[1:]), "bytes": statistics.median(moved[1:])}
            kv = pe.kv
            out["geometry"] = (kv.page_nbytes, kv.num_layers)
    return out


def kv_dtypes(a, prompts: dict) -> None:
    """KV bytes and transfer time per request, a bf16 cache against an FP8 one (same run, layer-wise)."""
    res = {kv: run_mode(a.model, True, prompts, a.repeats, a.page_size, "bfloat16", kv, max_tokens=2)
           for kv in ("auto", "fp8_e4m3")}
    geo = {kv: r.pop("geometry") for kv, r in res.items()}
    layers = geo["auto"][1]
    print(f"disagg bench, KV dtype: bf16 model, {layers} layers, page {a.page_size} tokens, tcp loopback, "
          f"layer-wise, median of {a.repeats}")
    print(f"{'prompt':>7} {'KV B/req bf16':>14} {'KV B/req fp8':>13} {'fp8/bf16':>9} {'move all ms bf16':>17} "
          f"{'move all ms fp8':>16} {'exposed ms bf16':>16} {'exposed ms fp8':>15}")
    for plen in prompts:
        pages = -(-(plen - 1) // a.page_size)
        move = {kv: 1e3 * move_pages(pages, geo[kv][0], layers, max(3, a.repeats)) for kv in res}
        b16, b8 = res["auto"][plen]["bytes"], res["fp8_e4m3"][plen]["bytes"]
        print(f"{plen:>7} {b16:>14,.0f} {b8:>13,.0f} {b8 / max(b16, 1):>9.3f} {move['auto']:>17.2f} "
              f"{move['fp8_e4m3']:>16.2f} {res['auto'][plen]['exposed_ms']:>16.2f} "
              f"{res['fp8_e4m3'][plen]['exposed_ms']:>15.2f}")


HANDOFF_ORDER = ("copy", "share")


def handoff_cost(num_pages: int, page_nbytes: int, num_layers: int, reps: int) -> dict:
    """Median seconds of one request's hand-off on shm without the model: writing its KV
    (``num_pages`` pages, ``num_layers`` layers) once, then getting it to the decode memory.
    copy: written into the prefill's own (warm) pages, then write_pages (memcpy); share:
    share_pages, written straight into the granted pages (page faults on fresh mappings
    included), write_pages (immediates only), unshare_pages."""
    import mmap

    from pdkv._messenger import Messenger

    n = num_pages * page_nbytes * num_layers
    bufs = [mmap.mmap(-1, n, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS) for _ in range(2)]
    src, dst = (np.frombuffer(b, dtype=np.uint8) for b in bufs)
    a, b = Messenger("shm", 11), Messenger("shm", 12)
    try:
        lkey, rkey = a.register(src), b.register(dst)
        ca, ia = a.prepare(12)
        cb, ib = b.prepare(11)
        a.complete(ca, ib)
        b.complete(cb, ia)
        src[:] = 1  # the prefill's own pages warm, as after its first requests
        pages = list(range(num_pages * num_layers))
        kv = np.random.default_rng(0).integers(0, 255, n, dtype=np.uint8)  # "computed" KV
        out = {}
        for mode in ("copy", "share"):
            times = []
            for r in range(reps + 1):
                imm = 1000 + r + (0 if mode == "copy" else 500)
                b.grant_range(rkey, 11, 0, n)
                b.expect(imm, len(pages))
                t = time.perf_counter()
                if mode == "share":
                    a.share_pages(ca, lkey, 0, rkey, 0, n)
                src[:] = kv
                a.write_pages(ca, lkey, rkey, pages, pages, seg_len=page_nbytes, src_page_stride=page_nbytes,
                              dst_page_stride=page_nbytes, imm=imm)
                while not any(e.kind == "imm_done" for e in b.drain()):
                    time.sleep(0.00005)
                if mode == "share":
                    a.unshare_pages(ca, lkey, 0, n)
                times.append(time.perf_counter() - t)
                a.drain()
                b.revoke_range(rkey, 11, 0, n)
            out[mode] = statistics.median(times[1:])
        st = a.stats()
        out["shared_writes"], out["copied_writes"] = st["shared_writes"], st["copied_writes"]
        return out
    finally:
        a.close()
        b.close()


def handoffs(a, prompts: dict) -> None:
    """disagg.kv_handoff copy against share, both on the shm transport, layer-wise, same run."""
    res = {h: run_mode(a.model, True, prompts, a.repeats, a.page_size, transport="shm", kv_handoff=h)
           for h in HANDOFF_ORDER}
    page_nbytes, layers = res["copy"].pop("geometry")
    res["share"].pop("geometry")
    print(f"disagg bench, KV hand-off on shm: {layers} layers, page {a.page_size} tokens = {page_nbytes} B per "
          f"layer, layer-wise, median of {a.repeats}")
    print(f"{'prompt':>7} {'exposed ms copy':>16} {'exposed ms share':>17} {'share/copy':>11} "
          f"{'request ms copy':>16} {'request ms share':>17} {'share/copy':>11}")
    for plen in prompts:
        c, s = res["copy"][plen], res["share"][plen]
        print(f"{plen:>7} {c['exposed_ms']:>16.2f} {s['exposed_ms']:>17.2f} "
              f"{s['exposed_ms'] / max(c['exposed_ms'], 1e-9):>11.2f} {c['request_ms']:>16.1f} "
              f"{s['request_ms']:>17.1f} {s['request_ms'] / max(c['request_ms'], 1e-9):>11.2f}")
    print("without the model (write the KV once, then hand it over; median of 7):")
    print(f"{'prompt':>7} {'KV MiB':>7} {'copy ms':>8} {'share ms':>9} {'share/copy':>11}")
    for plen in prompts:
        pages = -(-(plen - 1) // a.page_size)
        h = handoff_cost(pages, page_nbytes, layers, 7)
        print(f"{plen:>7} {pages * page_nbytes * layers / 2**20:>7.1f} {1e3 * h['copy']:>8.2f} "
              f"{1e3 * h['share']:>9.2f} {h['share'] / h['copy']:>11.2f}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="HF folder (default: the seeded ~50M tiny Llama)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--lengths", default="512,2048")
    ap.add_argument("--kv-dtypes", action="store_true",
                    help="instead: a bf16 model's KV per request with kv_cache.dtype auto (bf16) vs fp8_e4m3")
    ap.add_argument("--handoff", action="store_true",
                    help="instead: disagg.kv_handoff copy vs share on the shm transport (same run)")
    a = ap.parse_args(argv)
    tmp = None
    if a.model is None:
        from pdkv.tiny_model import make_tiny_model

        tmp = tempfile.TemporaryDirectory(prefix="pdkv-bench-")
        a.model = str(make_tiny_model(Path(tmp.name) / "bench-50m", hidden_size=512, num_layers=8, num_heads=8,
                                      num_kv_heads=2, intermediate_size=1536, vocab_size=32000,
                                      max_position_embeddings=4096, seed=0))
    rng = np.random.default_rng(0)
    prompts = {int(n): rng.integers(100, 31000, int(n)).tolist() for n in a.lengths.split(",")}
    if a.kv_dtypes or a.handoff:
        (kv_dtypes if a.kv_dtypes else handoffs)(a, prompts)
        if tmp is not None:
            tmp.cleanup()
        return 0
    res = {mode: run_mode(a.model, mode == "layerwise", prompts, a.repeats, a.page_size)
           for mode in ("layerwise", "after_forward")}
    page_nbytes, layers = res["layerwise"].pop("geometry")
    res["after_forward"].pop("geometry")
    print(f"disagg bench: {layers} layers, page {a.page_size} tokens = {page_nbytes} B per layer, tcp loopback, "
          f"median of {a.repeats}")
    print(f"{'prompt':>7} {'1 layer ms':>11} {'all layers ms':>14} {'exposed layer-wise ms':>22} "
          f"{'exposed after-fwd ms':>21} {'after/layerwise':>16} {'layerwise/1 layer':>18} {'request ms lw/af':>18}")
    for plen in prompts:
        pages = -(-(plen - 1) // a.page_size)
        one = 1e3 * move_pages(pages, page_nbytes, 1, max(3, a.repeats))
        every = 1e3 * move_pages(pages, page_nbytes, layers, max(3, a.repeats))
        lw, af = res["layerwise"][plen], res["after_forward"][plen]
        print(f"{plen:>7} {one:>11.2f} {every:>14.2f} {lw['exposed_ms']:>22.2f} {af['exposed_ms']:>21.2f} "
              f"{af['exposed_ms'] / max(lw['exposed_ms'], 1e-9):>16.2f} {lw['exposed_ms'] / one:>18.2f} "
              f"{lw['request_ms']:>8.0f}/{af['request_ms']:<8.0f}")
    if tmp is not None:
        tmp.cleanup()
    return 0
