"""One node's KV memory and sharding, whatever its TP degree: what the messenger registers and
what the handshake sends. With ``parallel.tp == 1`` the engine's own cache is the one region.

    regions = kv_regions(engine)   # [KVRegion(rank, address, nbytes, device, kv_heads, cache)]
    spec = shard_spec(engine)      # pdkv.shard.ShardSpec (tp, KVGeometry) for the handshake
"""

from __future__ import annotations

from pdkv.shard.spec import ShardSpec
from pdkv.tp.leader import KVRegion


def kv_regions(engine) -> list[KVRegion]:
    """Every rank's KV memory as rank 0 sees it, by rank (see KVRegion); a data-parallel
    group's front: every DP rank's pool (pdkv/dp/remote.py), as the front maps it."""
    if getattr(engine, "dp_regions", None) is not None:
        return list(engine.dp_regions)
    if engine.tp is not None:
        return list(engine.tp.regions)
    kv = engine.kv
    return [KVRegion(0, kv.data_ptr(0), kv.nbytes, str(kv.device), tuple(range(kv.num_kv_heads)), kv)]


def shard_spec(engine) -> ShardSpec:
    """This node's sharding of the KV cache (global head count, page geometry, TP degree)."""
    if engine.tp is not None:
        return engine.tp.shard_spec
    kv = engine.kv
    return ShardSpec(1, kv.geometry())  # an MLA latent says kv_parts=1, replicated
