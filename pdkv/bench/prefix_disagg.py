"""The disaggregated half of `python -m pdkv.bench prefix`: the same Mooncake window replayed
through a prefill node and a decode node (in this process, real HTTP, real control channel, tcp
loopback), prefix caching on or off on both nodes.

Each request is a streamed /v1/completions call made at its (compressed) arrival time from a
client thread; TTFT = arrival to the first SSE event carrying a token. Prompt tokens computed =
prompt positions fed to either node's model (the prefill node's chunks, the decode node's last
prompt token and any prompt it prefilled itself); KV bytes = what the decode node received
(``pdkv_kv_transfer_bytes_total``: page writes and hidden-state rows), pages moved and skipped
from the nodes' ``pdkv_kv_transfer_pages*`` counters.
"""

from __future__ import annotations

import http.client
import json
import statistics
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor


def _metric(url: str, name: str) -> float:
    text = urllib.request.urlopen(url + "/metrics", timeout=30).read().decode()
    return sum(float(x.split()[-1]) for x in text.splitlines() if x.startswith(name + " ") or x.startswith(name + "{"))


def _count_prompt_positions(engine, counter: dict, key: str) -> None:
    """Wraps the engine's runner (engine thread): prompt positions fed per step go to counter[key]."""
    execute = engine.runner.execute

    def counting(seqs, connector):
        for s in seqs:
            counter[key] += max(0, min(s.start_pos + len(s.token_ids), s.request.num_prompt_tokens) - s.start_pos)
        return execute(seqs, connector)
    engine.runner.execute = counting


def _stream(host: str, port: int, body: dict) -> tuple[float | None, list[int]]:
    """POST a streamed completion; (time.perf_counter of the first token event, token ids)."""
    conn = http.client.HTTPConnection(host, port, timeout=600)
    try:
        conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            raise RuntimeError(f"HTTP {resp.status}: {resp.read()[:300]!r}")
        first, ids = None, []
        while True:
            line = resp.readline()
            if not line:
                break
            line = line.strip()
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            ev = json.loads(line[6:])
            if "error" in ev:
                raise RuntimeError(f"stream error: {ev['error']}")
            for ch in ev.get("choices", []):
                if ch.get("token_ids"):
                    if first is None:
                        first = time.perf_counter()
                    ids += ch["token_ids"]
        return first, ids
    finally:
        conn.close()


def replay_disagg(model: str, window, speedup: float, page_size: int, num_pages: int, caching: bool,
                  max_model_len: int, threads: int = 1) -> dict:
    from pdkv.config import config_from_dict  # noqa: PLC0415
    from pdkv.disagg.node import build_node, kv_buffer_factory  # noqa: PLC0415
    from pdkv.engine import LLMEngine  # noqa: PLC0415
    from pdkv.server.app import NODE  # noqa: PLC0415
    from pdkv.server.runner import ServerThread  # noqa: PLC0415

    def cfg(role, **messenger):
        return config_from_dict({"role": role, "model": {"path": str(model), "max_model_len": max_model_len},
                                 "kv_cache": {"page_size": page_size, "num_pages": num_pages,
                                              "prefix_caching": caching},
                                 "server": {"port": 0}, "messenger": {"transfer_timeout_s": 600.0, **messenger},
                                 # every prompt crosses the pair (no conditional disaggregation): what
                                 # is measured is what the caches save on the transfer
                                 "disagg": {"local_prefill_max_tokens": 0, "max_prefill_queue_tokens": None,
                                            "local_fallback": False}})
    fed = {"prefill": 0, "decode": 0}
    pc = cfg("prefill")
    pe = LLMEngine.from_config(pc, kv_buffer=kv_buffer_factory("cpu"), num_threads=threads)
    _count_prompt_positions(pe, fed, "prefill")
    with ServerThread(pc, pe, build_node(pc, pe)) as pre:
        dc = cfg("decode", prefill_peers=[f"127.0.0.1:{pre.app[NODE].control_port}"])
        de = LLMEngine.from_config(dc, kv_buffer=kv_buffer_factory("cpu"), num_threads=threads)
        _count_prompt_positions(de, fed, "decode")
        with ServerThread(dc, de, build_node(dc, de)) as dec:
            name = json.loads(urllib.request.urlopen(dec.url + "/v1/models").read())["data"][0]["id"]
            host, port = dec.url.split("//")[1].split(":")
            first, outputs, errors, lock = {}, {}, [], threading.Lock()

            def call(rid, ids, n_out):
                try:
                    t, got = _stream(host, int(port), {"model": name, "prompt": ids, "max_tokens": n_out, "stream": True,
                                                       "temperature": 0, "ignore_eos": True, "return_token_ids": True})
                except Exception as e:  # noqa: BLE001 - counted and reported, the replay goes on
                    with lock:
                        errors.append(f"{rid}: {e}")
                    return
                with lock:
                    first[rid], outputs[rid] = t, got

            t0 = time.perf_counter()
            arrival = {}
            with ThreadPoolExecutor(128) as ex:
                for i, (at, ids, n_out, _) in enumerate(window):
                    delay = t0 + at / speedup - time.perf_counter()
                    if delay > 0:
                        time.sleep(delay)
                    rid = f"t{i}"
                    arrival[rid] = t0 + at / speedup
                    ex.submit(call, rid, ids, n_out)
            wall = time.perf_counter() - t0
            time.sleep(0.2)  # the prefill node counts a job once its last write completed
            counts = {f"{k}_{node}": _metric(url, f"pdkv_kv_transfer_{k}_total")
                      for node, url in (("decode", dec.url), ("prefill", pre.url))
                      for k in ("bytes", "pages", "pages_skipped")}
            stats = {"prefill": pe.stats(), "decode": de.stats()}
    ttft = sorted(first[r] - arrival[r] for r in first if first[r] is not None)
    return {"prompt_tokens_computed": fed["prefill"] + fed["decode"], "computed_prefill": fed["prefill"],
            "computed_decode": fed["decode"], "kv_bytes": counts["bytes_decode"], "wall_s": wall,
            "ttft_p50_ms": 1000 * statistics.median(ttft) if ttft else float("nan"),
            "ttft_p99_ms": 1000 * ttft[min(len(ttft) - 1, int(0.99 * len(ttft)))] if ttft else float("nan"),
            **counts, "prefill_cache_hits": stats["prefill"]["prefix_cache_hits"],
            "decode_cache_hits": stats["decode"]["prefix_cache_hits"], "errors": errors, "outputs": outputs}
