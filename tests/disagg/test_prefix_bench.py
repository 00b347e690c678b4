"""`python -m pdkv.bench prefix`'s disaggregated half on a small hand-made window (the replay
itself, not its numbers): caching on computes fewer prompt tokens and moves fewer KV bytes than
off by what the window repeats, nothing fails, and the greedy outputs are the same."""
from __future__ import annotations

import random

from pdkv.bench.prefix_disagg import replay_disagg


def test_disaggregated_replay_saves_what_the_window_repeats(tiny_model_dir):
    rng = random.Random(0)
    shared = [rng.randrange(3, 500) for _ in range(32)]  # 8 pages of 4
    window = []
    for i in range(8):  # arrivals 0.3 s apart (each lands before the next); every other one shares
        head = shared if i % 2 else [rng.randrange(3, 500) for _ in range(32)]
        window.append((0.3 * i, head + [rng.randrange(3, 500) for _ in range(6)], 3, []))
    runs = {on: replay_disagg(tiny_model_dir, window, 1.0, 4, 256, on, 64) for on in (False, True)}
    off, on = runs[False], runs[True]
    assert off["errors"] == on["errors"] == []
    assert off["outputs"] == on["outputs"] and len(off["outputs"]) == 8
    # off: every prompt token computed once, every page of tokens[:-1] moved (10 per request)
    assert off["prompt_tokens_computed"] == sum(len(w[1]) for w in window)
    assert off["pages_decode"] == off["pages_prefill"] == 80 and off["pages_skipped_decode"] == 0
    # on: requests 3, 5 and 7 find the shared 8 pages on both nodes (request 1 computed them)
    assert on["pages_skipped_decode"] == on["pages_skipped_prefill"] == 24
    assert on["pages_decode"] == on["pages_prefill"] == 80 - 24
    assert on["prompt_tokens_computed"] == off["prompt_tokens_computed"] - 3 * 32
    assert on["kv_bytes"] < off["kv_bytes"] and on["bytes_prefill"] == on["kv_bytes"]
