"""Shared by the disaggregated DP-EP decode tests (tests/dp/test_dp_disagg*.py): the prompts,
the colocated TP1 reference (tokens and each prompt's latent), HTTP helpers. The nodes' set-ups
are tests/disagg's (_cluster.py in process, _procs.py as children)."""

from __future__ import annotations

import json
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "disagg"))

from _cluster import make_engine, node_config, read_kv, wait_for  # noqa: E402

from pdkv.dp.group import DPGroup  # noqa: E402
from pdkv.engine import SamplingParams  # noqa: E402

MAX_TOKENS = 6
DP = {"parallel__dp": 2, "parallel__ep": True, "parallel__timeout_s": 30.0, "parallel__startup_timeout_s": 300.0}
# 18, 13 and 9 tokens: 5, 3 and 2 pages before the last token (page size 4)
PROMPTS = [list(range(3, 21)), list(range(40, 53)), list(range(80, 89))]


def dp_group(cfg):
    return DPGroup.from_config(cfg)


def complete(url: str, name: str, prompt: list[int], max_tokens: int = MAX_TOKENS) -> dict:
    body = json.dumps({"model": name, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                       "ignore_eos": True, "return_token_ids": True}).encode()
    req = urllib.request.Request(url + "/v1/completions", body, {"Content-Type": "application/json"})
    try:
        return json.loads(urllib.request.urlopen(req, timeout=60).read())
    except urllib.error.HTTPError as e:
        return {"status": e.code, "error": e.read().decode()}


def together(url: str, name: str, prompts: list, gap_s: float = 0.0, group: DPGroup | None = None) -> list[dict]:
    """The prompts in flight at once, started in order; with ``group``, each one once the one
    before it was placed (so placement sees it: a fixed gap lets a fast request finish first)."""
    got: list = [None] * len(prompts)

    def run(i):
        got[i] = complete(url, name, prompts[i])

    def placed() -> int:
        return group.placer.placed_by_load + group.placer.placed_by_affinity
    threads = []
    for i in range(len(prompts)):
        before = placed() if group is not None else 0
        threads.append(threading.Thread(target=run, args=(i,)))
        threads[-1].start()
        if group is not None:
            wait_for(lambda: placed() > before, 30, f"request {i} placed")
        else:
            time.sleep(gap_s or 0.05)  # in order: the first is placed first, on the less loaded rank
    for t in threads:
        t.join(90)
    return got


def pools_back(group: DPGroup) -> bool:
    """Every page of every rank free, none held, no request left (call it with no engine thread
    driving the group: the ranks' channels are not shared between threads)."""
    ranks = group.load()["ranks"]
    return all(r["free_pages"] == r["total_pages"] and r["held_pages"] == 0 and r["requests"] == 0 for r in ranks)


def match_kv(cache, pages, kv_refs) -> list[int]:
    """The reference prompts whose KV the pool ``cache`` holds in ``pages``, bit for bit."""
    import torch  # noqa: PLC0415

    out = []
    for i, ref in enumerate(kv_refs):
        n = ref[0].shape[1]
        if -(-n // 4) == len(pages) and all(torch.equal(a, b) for a, b in zip(read_kv(cache, pages, n), ref)):
            out.append(i)
    return out


@pytest.fixture(scope="module")
def reference(moe_models):
    """Greedy tokens and each prompt's KV (the first n-1 positions) from a colocated TP1 engine."""
    folder = moe_models["deepseek_v3"]
    eng = make_engine(node_config(folder, "colocated"))
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    tokens = [o.output_token_ids for o in eng.generate(PROMPTS, params)]
    kv = []
    eng = make_engine(node_config(folder, "colocated", kv_cache__prefix_caching=False))  # every page computed
    for i, p in enumerate(PROMPTS):
        # the prompt less its last token, as the prefill node computes it (the same chunks)
        eng.add_request(f"kv-{i}", p[:-1], SamplingParams(max_tokens=2, temperature=0.0))
        req = eng.requests[f"kv-{i}"]
        while req.num_computed_tokens < len(p) - 1:
            eng.step()
        kv.append(read_kv(eng.kv, req.pages, len(p) - 1))  # read before it ends and frees them
        while eng.has_unfinished():
            eng.step()
    return tokens, kv
