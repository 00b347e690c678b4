"""The shard planner per request: a 4,096-token prompt between prefill TP 8 and decode TP 8 or 1,
for a dense GQA cache (8 KV heads, Llama-70B-like) and a replicated MLA latent (DeepSeek-like).

What a request costs is the plan lookup (``plan_transfers`` is cached per geometry: the plan
itself is built once per peer, at the handshake), its replica assignment and its counts; the
cold plan is benchmarked too, as the cost of a handshake."""

from __future__ import annotations

import pytest

from pdkv.disagg.writes import batches_per_layer, expected_writes
from pdkv.shard import KVGeometry, plan_transfers, request_seed

TOKENS, PAGE, LAYERS = 4096, 16, 80
NUM_PAGES = TOKENS // PAGE
DENSE = KVGeometry(num_kv_heads=8, head_dim=128, page_size=PAGE, dtype="bfloat16", layout="HND")
LATENT = KVGeometry(num_kv_heads=1, head_dim=576, page_size=PAGE, dtype="bfloat16", layout="HND",
                    replicated=True)
CASES = [(8, 8, DENSE), (8, 1, DENSE), (8, 8, LATENT), (8, 1, LATENT)]
IDS = ["tp8to8-dense", "tp8to1-dense", "tp8to8-replicated", "tp8to1-replicated"]


def plan_request(tp_p: int, tp_d: int, geometry: KVGeometry, request_id: str):
    plan = plan_transfers(tp_p, tp_d, geometry)
    seed = request_seed(request_id)
    pairs = plan.active_pairs(seed)
    return plan, pairs, expected_writes(plan, NUM_PAGES, LAYERS), batches_per_layer(plan, seed)


def check(tp_p, tp_d, geometry, plan, pairs, expected, batches):
    """The assertions of tests/shard/test_plan_bytes.py for these shapes."""
    assert sorted({pp.decode_rank for pp in pairs}) == list(range(tp_d))
    seg_bytes = {d: sum(s.length for pp in pairs if pp.decode_rank == d for s in pp.segments) for d in range(tp_d)}
    assert all(n == plan.decode.page_bytes for n in seg_bytes.values()), "a decode page is not filled exactly"
    if tp_p == tp_d:  # one-to-one: a bijection of ranks, one write per page
        assert len({pp.prefill_rank for pp in pairs}) == tp_p
        assert all(len(pp.segments) == 1 and pp.segments[0].length == plan.decode.page_bytes for pp in pairs)
    if geometry.replicated:  # every rank holds the whole latent: one source per decode rank
        assert len(pairs) == tp_d and plan.writes_per_page == (1,) * tp_d
    elif tp_d == 1:  # rebuild from 8 ranks: one K and one V extent from each
        assert plan.writes_per_page == (2 * tp_p,)
    assert expected == sum(plan.writes_per_page) * NUM_PAGES * LAYERS + 1
    assert batches == sum(len(pp.segments) for pp in pairs)


@pytest.mark.parametrize("tp_p,tp_d,geometry", CASES, ids=IDS)
def test_shard_plan_per_request(benchmark, budget, tp_p, tp_d, geometry):
    ids = iter(range(10**9))
    out = benchmark(lambda: plan_request(tp_p, tp_d, geometry, f"req-{next(ids)}"))
    budget(unit="one request admitted", per_step=1, budget_pct=1, per_step_b1=1)
    check(tp_p, tp_d, geometry, *out)


@pytest.mark.parametrize("tp_p,tp_d,geometry", CASES, ids=IDS)
def test_shard_plan_cold(benchmark, tp_p, tp_d, geometry):
    """The uncached plan: what a handshake with a new peer pays once."""
    def cold():
        plan_transfers.cache_clear()
        return plan_request(tp_p, tp_d, geometry, "req-cold")

    check(tp_p, tp_d, geometry, *benchmark(cold))
