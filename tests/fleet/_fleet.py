"""Helpers for fleet tests: node configs with etcd discovery, load generators, page checks."""
from __future__ import annotations

import json
import random
import threading
import time
import urllib.error
import urllib.request

from _procs import NodeProc, free_port, node_dict  # noqa: F401  (tests/disagg helpers)


def fleet_node(model_dir, role: str, etcd_url: str, node_id: str, **kw) -> dict:
    d = node_dict(model_dir, role, port=free_port(), **kw)
    d["cluster"] = {"discovery": "etcd", "name": "t", "node_id": node_id, "lease_ttl_s": 2,
                    "etcd": {"endpoints": [etcd_url], "timeout_s": 1.0}, "drain_notice_s": 0.5,
                    "drain_timeout_s": 30}
    return d


def get(url: str, timeout: float = 5) -> dict:
    return json.loads(urllib.request.urlopen(url, timeout=timeout).read())


def post(url: str, body: dict, timeout: float = 60, headers: dict | None = None) -> tuple[int, dict | str]:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json",
                                                                 **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        raw = e.read()
        try:
            return e.code, json.loads(raw)
        except ValueError:
            return e.code, raw.decode(errors="replace")


def wait_for(pred, timeout: float, what: str, step: float = 0.02, info=None):
    end = time.monotonic() + timeout
    last = None
    while time.monotonic() < end:
        try:
            last = pred()
            if last:
                return last
        except OSError as e:
            last = e
        time.sleep(step)
    raise AssertionError(f"timed out after {timeout} s waiting for {what} (last: {last!r})"
                         + (f"; {info()}" if info is not None else ""))


def connected_peers(dec: NodeProc) -> list[str]:
    return [p["address"] for p in get(dec.url + "/health")["prefill_peers"] if p["connected"]]


def routed(dec: NodeProc) -> dict[str, int]:
    return {p["address"]: p["routed"] for p in get(dec.url + "/health")["prefill_peers"]}


class Load:
    """Clients posting completions in a loop until stopped; every answer recorded."""

    def __init__(self, url: str, model: str, clients: int = 2, prompt_len: int = 40, max_tokens: int = 4):
        self.url, self.model = url, model
        self.results: list[tuple[int, object]] = []
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(i, prompt_len, max_tokens), daemon=True)
                         for i in range(clients)]

    def _run(self, i: int, n: int, max_tokens: int) -> None:
        k = 0
        while not self._stop.is_set():
            k += 1
            rng = random.Random(i * 1_000_003 + k)  # distinct prompts: no cache hit, no prefix affinity
            prompt = [rng.randrange(5, 500) for _ in range(n)]
            self.results.append(post(self.url + "/v1/completions", {"model": self.model, "prompt": prompt,
                                                                    "max_tokens": max_tokens}))

    def __enter__(self) -> "Load":
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(60)

    def failures(self) -> list:
        return [r for r in self.results if r[0] != 200]


def model_name(url: str) -> str:
    return get(url + "/v1/models")["data"][0]["id"]


def pages_back(node: NodeProc) -> bool:
    h = get(node.url + "/health")
    return h["num_pages_free"] == h["num_pages_total"] and not h["num_pages_held"]  # free counts evictable ones
