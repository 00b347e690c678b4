"""Combinations the planner cannot serve are refused with an error that names them."""

from __future__ import annotations

import pytest

from pdkv.errors import PdkvError
from pdkv.shard import KVGeometry, ShardPlanError, ShardSpec, check_compatible, plan_specs, plan_transfers

GEO = KVGeometry(num_kv_heads=8, head_dim=128, page_size=16, dtype="bfloat16", layout="HND")


@pytest.mark.parametrize(
    "prefill_tp, decode_tp, heads, words",
    [
        (3, 1, 8, ["prefill tp=3", "8 KV heads", "not divisible by 3"]),
        (1, 6, 8, ["decode tp=6", "8 KV heads"]),
        (6, 2, 4, ["prefill tp=6", "replicate 4 KV heads", "not a multiple of 4"]),
        (2, 8, 3, ["prefill tp=2", "decode tp=8", "replicate 3 KV heads"]),  # both sides named
        (0, 2, 8, ["prefill tp", "positive integer", "0"]),
        (2, True, 8, ["decode tp", "True"]),
    ],
)
def test_indivisible_heads_are_named(prefill_tp, decode_tp, heads, words):
    geometry = KVGeometry(heads, 128, 16, "bfloat16", "HND")
    with pytest.raises(ShardPlanError) as err:
        plan_transfers(prefill_tp, decode_tp, geometry)
    for word in words:
        assert word in str(err.value)
    assert isinstance(err.value, (PdkvError, ValueError))


def test_replicated_latent_serves_any_tp():
    # An MLA latent is one vector every rank keeps whole: no divisibility to satisfy.
    plan = plan_transfers(3, 5, KVGeometry(1, 576, 64, "bfloat16", "HND", replicated=True))
    assert plan.writes_per_page == (1,) * 5


@pytest.mark.parametrize(
    "kwargs, words",
    [
        (dict(dtype="auto"), ["dtype", "'auto'"]),
        (dict(layout="HDN"), ["layout must be HND or NHD", "'HDN'"]),
        (dict(head_dim=0), ["head_dim", "0"]),
        (dict(page_size=2.5), ["page_size", "2.5"]),
        (dict(num_kv_heads=-1), ["num_kv_heads", "-1"]),
        (dict(replicated="yes"), ["replicated", "'yes'"]),
    ],
)
def test_bad_geometry_fields_are_named(kwargs, words):
    fields = dict(num_kv_heads=8, head_dim=128, page_size=16, dtype="bfloat16", layout="HND")
    with pytest.raises(ShardPlanError) as err:
        KVGeometry(**{**fields, **kwargs})
    for word in words:
        assert word in str(err.value)


def test_sides_that_disagree_on_the_cache_are_refused_naming_each_field():
    other = KVGeometry(num_kv_heads=4, head_dim=128, page_size=16, dtype="bfloat16", layout="NHD")
    with pytest.raises(ShardPlanError) as err:
        check_compatible(ShardSpec(2, GEO, "prefill"), ShardSpec(4, other, "decode"))
    msg = str(err.value)
    assert "prefill tp=2 and decode tp=4" in msg
    assert "num_kv_heads 8 (prefill) != 4 (decode)" in msg
    assert "layout 'HND' (prefill) != 'NHD' (decode)" in msg
    assert "head_dim" not in msg  # only what differs
    with pytest.raises(ShardPlanError):
        plan_specs(ShardSpec(2, GEO, "prefill"), ShardSpec(4, other, "decode"))


def test_bad_wire_specs_are_named():
    with pytest.raises(ShardPlanError, match="decode shard spec must be a mapping"):
        ShardSpec.from_wire({"tp": 2}, role="decode")
    wire = ShardSpec(2, GEO).to_wire()
    del wire["geometry"]["page_size"]
    with pytest.raises(ShardPlanError, match="missing page_size"):
        ShardSpec.from_wire(wire, role="prefill")
    wire = ShardSpec(3, KVGeometry(6, 64, 16, "float16")).to_wire()
    wire["tp"] = 4
    with pytest.raises(ShardPlanError, match="prefill tp=4 cannot shard 6 KV heads"):
        ShardSpec.from_wire(wire, role="prefill")


def test_bad_request_arguments_are_named():
    plan = plan_transfers(2, 4, GEO)
    with pytest.raises(ShardPlanError, match="request seed"):
        plan.active_pairs(-1)
    with pytest.raises(ShardPlanError, match="request seed"):
        plan.assign_sources(2**64)
    with pytest.raises(ShardPlanError, match="decode rank 4 out of range for tp=4"):
        plan.expected_writes(4, 1, 1)
    with pytest.raises(ShardPlanError, match="num_pages"):
        plan.expected_writes(0, -3, 1)
    with pytest.raises(ShardPlanError, match="num_layers"):
        plan.expected_writes_total(3, 1.5)
    # The plan is unchanged by refused calls.
    assert plan.expected_writes(0, 3, 2) == 12


def test_describe_names_the_plan():
    text = plan_transfers(8, 2, GEO).describe()
    assert "prefill tp=8 -> decode tp=2" in text and "rebuild" in text
    assert "p3->d0 head 3: 2 write(s)/page" in text
    assert "d0=8, d1=8 (total 16)" in text
    assert "1 replica set(s): {0,1,2,3,4,5,6,7}" in text
