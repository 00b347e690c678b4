"""Sharded KV transfers: a pure planner from (prefill TP, decode TP, KV geometry) to page writes.

    from pdkv.shard import KVGeometry, plan_transfers, request_seed
    plan = plan_transfers(2, 4, KVGeometry(num_kv_heads=8, head_dim=128, page_size=16,
                                           dtype="bfloat16", layout="HND"))
    for pair in plan.active_pairs(request_seed("req-17")):
        ...  # post pair.segments for every page and layer: prefill rank -> decode rank
    plan.expected_writes(decode_rank=0, num_pages=5, num_layers=32)

``spec``: head ownership, replica sets, page offsets of one side. ``assign``: the seeded choice
of a source replica set per destination replica set. ``plan``: segments, counts, describe().
No tensors, no I/O: both nodes compute the same plan from the handshake's ShardSpecs.
"""

from pdkv.shard.assign import assign_sources, pick_nic, request_seed, splitmix64
from pdkv.shard.plan import PairPlan, Segment, ShardPlan, check_compatible, plan_specs, plan_transfers
from pdkv.shard.spec import DTYPE_SIZES, LAYOUTS, KVGeometry, ShardPlanError, ShardSpec

__all__ = [
    "DTYPE_SIZES",
    "LAYOUTS",
    "KVGeometry",
    "PairPlan",
    "Segment",
    "ShardPlan",
    "ShardPlanError",
    "ShardSpec",
    "assign_sources",
    "check_compatible",
    "pick_nic",
    "plan_specs",
    "plan_transfers",
    "request_seed",
    "splitmix64",
]
