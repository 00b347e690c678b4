"""The MLA latent cache through the shard planner: "one KV head, replicated on every rank".

A DeepSeek-V3 page holds one latent vector (kv_lora_rank + qk_rope_head_dim values) per token and
no K/V split (kv_parts=1). Every TP rank holds the whole cache, so every rank is its own replica
set: a destination page is written once, from one source replica chosen per request by seed.
"""

from __future__ import annotations

import collections
import itertools

import pytest

from pdkv.shard import KVGeometry, ShardPlanError, ShardSpec, plan_specs, plan_transfers, request_seed
from test_plan_bytes import HEAD_DIM, PAGE, TPS, replay

# DeepSeek-R1's latent: 512 + 64 values per token and layer.
R1 = dict(num_kv_heads=1, head_dim=576, page_size=16, dtype="bfloat16", replicated=True, kv_parts=1)


@pytest.mark.parametrize("layout", ["HND", "NHD"])
def test_latent_bytes_replay_over_every_tp_pair(layout):
    for tp_p, tp_d in itertools.product(TPS, TPS):
        plan = replay(tp_p, tp_d, 1, layout, True, kv_parts=1)
        assert plan.prefill.page_bytes == PAGE * HEAD_DIM * 2  # one part, one head, float16
        # Every destination rank gets its whole page in one write from exactly one source rank.
        assert plan.writes_per_page == (1,) * tp_d


def test_latent_page_is_one_contiguous_write_whatever_the_layout():
    for layout in ("HND", "NHD"):
        plan = plan_transfers(8, 8, KVGeometry(**R1, layout=layout))
        assert plan.prefill.page_bytes == 576 * 16 * 2
        for seed in range(20):
            pairs = plan.active_pairs(seed)
            assert [pp.decode_rank for pp in pairs] == list(range(8))
            assert all(pp.segments == (pp.segments[0],) and pp.segments[0].length == 576 * 16 * 2 for pp in pairs)


def test_tp2_to_tp1_spreads_pages_over_both_prefill_ranks():
    """Many seeded requests of different sizes: each prefill rank sends about half the pages."""
    plan = plan_transfers(2, 1, KVGeometry(**R1, layout="HND"))
    pages = collections.Counter()
    total = 0
    for i in range(2000):
        n = 1 + (i * 7919) % 37  # 1..37 pages
        (pair,) = plan.active_pairs(request_seed(f"req-{i}"))
        pages[pair.prefill_rank] += n
        total += n
        assert plan.expected_writes(0, n, 61) == n * 61  # one write per page and layer
    assert set(pages) == {0, 1}
    for rank in (0, 1):
        assert 0.45 < pages[rank] / total < 0.55, pages


def test_tp2_to_tp2_every_decode_rank_gets_the_full_latent_from_distinct_sources():
    plan = plan_transfers(2, 2, KVGeometry(**R1, layout="HND"))
    sources = collections.Counter()
    for i in range(200):
        pairs = plan.active_pairs(request_seed(f"r{i}"))
        assert [pp.decode_rank for pp in pairs] == [0, 1]
        assert len({pp.prefill_rank for pp in pairs}) == 2  # both NICs carry the request
        assert all(pp.segments[0].length == plan.decode.page_bytes for pp in pairs)
        sources.update((pp.prefill_rank, pp.decode_rank) for pp in pairs)
    assert len(sources) == 4  # every (prefill, decode) pairing occurs over many requests
    assert plan.expected_writes_total(5, 61) == 2 * 5 * 61


def test_latent_and_kv_caches_refuse_to_plan_together():
    latent = ShardSpec(2, KVGeometry(**R1, layout="HND"), role="prefill")
    kv = ShardSpec(1, KVGeometry(1, 576, 16, "bfloat16", "HND", replicated=True), role="decode")
    with pytest.raises(ShardPlanError, match=r"kv_parts 1 \(prefill\) != 2 \(decode\)"):
        plan_specs(latent, kv)
    with pytest.raises(ShardPlanError, match="kv_parts must be 2 .* or 1"):
        KVGeometry(1, 576, 16, "bfloat16", kv_parts=3)


def test_latent_geometry_survives_the_handshake_wire():
    spec = ShardSpec(8, KVGeometry(**R1, layout="HND"), role="decode")
    back = ShardSpec.from_wire(spec.to_wire(), role="decode")
    assert back == spec and back.geometry.kv_parts == 1
    assert "latent" in plan_transfers(8, 1, spec.geometry).describe()
    # An older peer's wire dict (no kv_parts) still means a K/V cache.
    wire = spec.to_wire()["geometry"]
    del wire["kv_parts"]
    assert KVGeometry.from_wire(wire).kv_parts == 2


def test_engine_caches_report_their_geometry():
    import torch

    from pdkv.kv import KVCache

    kv = KVCache(2, 4, 16, 1, 576, torch.bfloat16, "NHD", kv_parts=1)
    assert kv.geometry() == KVGeometry(**R1, layout="NHD")
    assert kv.page_nbytes == 576 * 16 * 2 and kv.layer(0).shape == (4, 1, 16, 1, 576)
    assert KVCache(2, 4, 16, 2, 8, torch.float32).geometry() == KVGeometry(2, 8, 16, "float32", "HND")
