"""One side's KV sharding: which KV heads each tensor-parallel rank holds, and where in its page.

A rank's page (one layer, one page id) holds only that rank's local heads:

    HND: [2, kv_heads_local, page_size, head_dim]   # K then V; one head's tokens are contiguous
    NHD: [2, page_size, kv_heads_local, head_dim]   # K then V; one token's heads are contiguous

Head ownership follows vLLM's convention:

- ``num_kv_heads >= tp``: rank r holds heads [r * n, (r + 1) * n) with n = num_kv_heads // tp.
- ``num_kv_heads < tp``: each head lives on R = tp // num_kv_heads ranks; rank r holds head r // R.
- ``replicated`` (an MLA latent, one vector that every rank needs): every rank holds every head.

``kv_parts`` is 2 for a K/V cache and 1 for an MLA latent (DeepSeek-V3: per token and layer one
vector of kv_lora_rank + qk_rope_head_dim values, no K/V split, ``num_kv_heads`` 1). A latent
page is then [1, 1, page_size, latent_dim] in either layout: one contiguous run of bytes.

A **replica set** is a group of ranks that together hold exactly one full copy of the cache
(the seed: "set di repliche che replicano l'intera cache KV al loro interno"). Set k is
{h * R + k for every head h}: one rank per head. Without replication there is one set (all
ranks); a replicated cache has one set per rank. Every set has the same shape, so which set a
transfer uses changes which NICs carry it, never how many writes it takes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pdkv.errors import PdkvError

LAYOUTS = ("HND", "NHD")
# Element sizes in bytes. "auto" is deliberately absent: the planner needs the resolved dtype.
DTYPE_SIZES = {
    "float32": 4,
    "bfloat16": 2,
    "float16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "int8": 1,
    "uint8": 1,
}


class ShardPlanError(PdkvError, ValueError):
    """A sharding combination the planner cannot serve; the message names the combination."""


def _positive_int(name: str, value: Any) -> None:
    # bool is an int subclass; tp=True is a bug, not a TP degree of 1.
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ShardPlanError(f"{name} must be a positive integer, got {value!r}")


@dataclass(frozen=True)
class KVGeometry:
    """What both sides must agree on: the logical KV cache of one layer, one page."""

    num_kv_heads: int
    head_dim: int
    page_size: int  # tokens per page
    dtype: str
    layout: str = "HND"
    replicated: bool = False  # MLA-style latent: every rank holds the whole cache
    kv_parts: int = 2  # 2: K and V; 1: one latent vector per token (MLA)

    def __post_init__(self) -> None:
        _positive_int("num_kv_heads", self.num_kv_heads)
        _positive_int("head_dim", self.head_dim)
        _positive_int("page_size", self.page_size)
        if self.dtype not in DTYPE_SIZES:
            raise ShardPlanError(
                f"dtype must be one of {sorted(DTYPE_SIZES)} (resolved, not 'auto'), got {self.dtype!r}"
            )
        if self.layout not in LAYOUTS:
            raise ShardPlanError(f"layout must be HND or NHD, got {self.layout!r}")
        if not isinstance(self.replicated, bool):
            raise ShardPlanError(f"replicated must be a bool, got {self.replicated!r}")
        if isinstance(self.kv_parts, bool) or self.kv_parts not in (1, 2):
            raise ShardPlanError(f"kv_parts must be 2 (K and V) or 1 (an MLA latent), got {self.kv_parts!r}")

    @property
    def elem_size(self) -> int:
        return DTYPE_SIZES[self.dtype]

    def to_wire(self) -> dict[str, Any]:
        """Plain dict for the handshake (msgpack/JSON)."""
        return {
            "num_kv_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "page_size": self.page_size,
            "dtype": self.dtype,
            "layout": self.layout,
            "replicated": self.replicated,
            "kv_parts": self.kv_parts,
        }

    @classmethod
    def from_wire(cls, d: Any) -> KVGeometry:
        if not isinstance(d, dict):
            raise ShardPlanError(f"KV geometry must be a mapping, got {type(d).__name__}")
        fields = ("num_kv_heads", "head_dim", "page_size", "dtype", "layout", "replicated")
        missing = [f for f in fields if f not in d]
        if missing:
            raise ShardPlanError(f"KV geometry is missing {', '.join(missing)}")
        return cls(**{f: d[f] for f in fields}, kv_parts=d.get("kv_parts", 2))


@dataclass(frozen=True)
class ShardSpec:
    """One node's sharding: a TP degree applied to a KV geometry. Validated on construction."""

    tp: int
    geometry: KVGeometry
    role: str = "rank"  # "prefill" / "decode": only used to name the side in error messages

    def __post_init__(self) -> None:
        _positive_int(f"{self.role} tp", self.tp)
        g, tp = self.geometry, self.tp
        if g.replicated or tp == 1:
            return
        h = g.num_kv_heads
        if h >= tp and h % tp:
            raise ShardPlanError(
                f"{self.role} tp={tp} cannot shard {h} KV heads: {h} is not divisible by {tp} "
                f"(each rank must hold the same number of whole heads)"
            )
        if h < tp and tp % h:
            raise ShardPlanError(
                f"{self.role} tp={tp} cannot replicate {h} KV heads: {tp} is not a multiple of {h} "
                f"(each head must live on the same number of ranks)"
            )

    @property
    def heads_per_rank(self) -> int:
        g = self.geometry
        return g.num_kv_heads if g.replicated else max(1, g.num_kv_heads // self.tp)

    @property
    def num_replicas(self) -> int:
        """R: how many ranks hold each head (= number of replica sets)."""
        g = self.geometry
        return self.tp if g.replicated else max(1, self.tp // g.num_kv_heads)

    def heads_of(self, rank: int) -> range:
        """Global KV heads held by ``rank``, in local order (local index = head - start)."""
        if not 0 <= rank < self.tp:
            raise ShardPlanError(f"{self.role} rank {rank} out of range for tp={self.tp}")
        g, n = self.geometry, self.heads_per_rank
        if g.replicated:
            return range(g.num_kv_heads)
        if g.num_kv_heads >= self.tp:
            return range(rank * n, rank * n + n)
        head = rank // self.num_replicas
        return range(head, head + 1)

    @property
    def replica_sets(self) -> tuple[tuple[int, ...], ...]:
        """Set k = the ranks with rank % R == k; each holds one full copy of the cache."""
        r = self.num_replicas
        return tuple(tuple(range(k, self.tp, r)) for k in range(r))

    @property
    def page_bytes(self) -> int:
        """Bytes of one rank's page (one layer): kv_parts * heads_per_rank * page_size * head_dim * elem."""
        g = self.geometry
        return g.kv_parts * self.heads_per_rank * g.page_size * g.head_dim * g.elem_size

    def offset(self, kv: int, local_head: int, token: int) -> int:
        """Byte offset in this side's rank page of the head_dim vector (kv, local_head, token)."""
        g, hl = self.geometry, self.heads_per_rank
        if g.layout == "HND":
            index = (kv * hl + local_head) * g.page_size + token
        else:
            index = (kv * g.page_size + token) * hl + local_head
        return index * g.head_dim * g.elem_size

    def to_wire(self) -> dict[str, Any]:
        return {"tp": self.tp, "geometry": self.geometry.to_wire()}

    @classmethod
    def from_wire(cls, d: Any, role: str = "rank") -> ShardSpec:
        if not isinstance(d, dict) or "tp" not in d or "geometry" not in d:
            raise ShardPlanError(f"{role} shard spec must be a mapping with 'tp' and 'geometry', got {d!r}")
        return cls(tp=d["tp"], geometry=KVGeometry.from_wire(d["geometry"]), role=role)
