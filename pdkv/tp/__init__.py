"""Tensor parallelism across processes on one node: rank 0 (the engine) leads, ranks 1..tp-1
follow its steps (pdkv/tp/leader.py, pdkv/tp/worker.py). The model split itself is in
models/parallel.py; see docs/TP.md."""

from pdkv.tp.followers import TPRankError
from pdkv.tp.leader import KVRegion, TPLeader
from pdkv.tp.node import kv_regions, shard_spec

__all__ = ["KVRegion", "TPLeader", "TPRankError", "kv_regions", "shard_spec"]
