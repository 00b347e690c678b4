"""The shard plan: which bytes of which prefill rank's page go where in which decode rank's page.

Offsets are relative to one page of one layer on one rank (see ``spec`` for the page shapes);
the messenger adds each side's page base address. Pages move whole (a prompt's last, partly
filled page too): the decode side reserved the full page, and whole pages keep the write count
a function of the page count alone, which both sides know.

How the segments are found: every (K or V, head[, token]) piece the pair shares is listed as
(dst offset, src offset, length); sorted by destination, neighbours that are contiguous on
both sides are merged. That gives the fewest writes the two layouts allow:

- equal sharding: the two pages are byte-identical in shape -> one write per page;
- HND: a head's tokens are contiguous and a rank's heads are adjacent -> at most one write for K
  and one for V per (prefill rank, decode rank) pair, whatever the TP ratio;
- NHD: a head's tokens are strided by the other local heads -> one write per token for K and
  for V unless the pair moves whole token rows (then the rows merge).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

from pdkv.shard.assign import assign_sources
from pdkv.shard.spec import KVGeometry, ShardPlanError, ShardSpec


@dataclass(frozen=True)
class Segment:
    """One write: ``length`` bytes from ``src_offset`` in the prefill rank's page to
    ``dst_offset`` in the decode rank's page."""

    src_offset: int
    dst_offset: int
    length: int


@dataclass(frozen=True)
class PairPlan:
    """The writes of one page from one prefill rank to one decode rank."""

    prefill_rank: int
    decode_rank: int
    heads: range  # global KV heads this pair moves (both ranks hold them)
    segments: tuple[Segment, ...]


@dataclass(frozen=True)
class ShardPlan:
    """The whole transfer plan between a prefill node and a decode node.

    ``pairs`` lists every (prefill rank, decode rank) that share a head, over all source
    replicas; a request uses the subset ``active_pairs(seed)``. ``writes_per_page[d]`` is the
    number of writes decode rank d receives per page per layer, for every seed (all source
    replica sets have the same shape).
    """

    prefill: ShardSpec
    decode: ShardSpec
    pairs: tuple[PairPlan, ...]
    writes_per_page: tuple[int, ...]  # [decode tp]
    _index: dict = field(init=False, repr=False, compare=False, hash=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_index", {(p.prefill_rank, p.decode_rank): p for p in self.pairs})

    @property
    def geometry(self) -> KVGeometry:
        return self.prefill.geometry

    def segments(self, prefill_rank: int, decode_rank: int) -> tuple[Segment, ...]:
        """Writes per page from ``prefill_rank`` to ``decode_rank``; empty if they share no head."""
        pair = self._index.get((prefill_rank, decode_rank))
        return pair.segments if pair else ()

    def assign_sources(self, seed: int) -> tuple[int, ...]:
        """Prefill replica set index for each decode replica set, for the request with ``seed``."""
        return assign_sources(len(self.prefill.replica_sets), len(self.decode.replica_sets), seed)

    def active_pairs(self, seed: int) -> tuple[PairPlan, ...]:
        """The pairs that carry the request with ``seed``, ordered by decode rank then prefill rank."""
        chosen = self.assign_sources(seed)
        out = []
        for j, dst_set in enumerate(self.decode.replica_sets):
            src_set = self.prefill.replica_sets[chosen[j]]
            for d in dst_set:
                out.extend(self._index[(p, d)] for p in src_set if (p, d) in self._index)
        out.sort(key=lambda pp: (pp.decode_rank, pp.prefill_rank))
        return tuple(out)

    def expected_writes(self, decode_rank: int, num_pages: int, num_layers: int) -> int:
        """Writes decode rank ``decode_rank`` receives for a request of num_pages x num_layers."""
        if not 0 <= decode_rank < self.decode.tp:
            raise ShardPlanError(f"decode rank {decode_rank} out of range for tp={self.decode.tp}")
        return self.writes_per_page[decode_rank] * _count("num_pages", num_pages) * _count(
            "num_layers", num_layers
        )

    def expected_writes_total(self, num_pages: int, num_layers: int) -> int:
        """Writes the whole decode node receives for the request (all ranks)."""
        return sum(self.writes_per_page) * _count("num_pages", num_pages) * _count("num_layers", num_layers)

    def describe(self) -> str:
        g, src, dst = self.geometry, self.prefill, self.decode
        lines = [
            f"shard plan: prefill tp={src.tp} -> decode tp={dst.tp}; {g.num_kv_heads} KV heads x "
            f"{g.head_dim} dim, page {g.page_size} tokens, {g.dtype}, {g.layout}"
            + (", latent (one vector per token)" if g.kv_parts == 1 else "")
            + (", replicated on every rank" if g.replicated else ""),
        ]
        for name, s in (("prefill", src), ("decode", dst)):
            sets = " ".join("{" + ",".join(map(str, rs)) + "}" for rs in s.replica_sets)
            lines.append(
                f"  {name}: {s.heads_per_rank} head(s)/rank, page {s.page_bytes} B/rank/layer, "
                f"{len(s.replica_sets)} replica set(s): {sets}"
            )
        mode = "one-to-one" if src.tp == dst.tp else ("split" if dst.tp > src.tp else "rebuild")
        lines.append(f"  {mode}; {len(self.pairs)} candidate pair(s) over all source replicas")
        for pp in self.pairs:
            segs = pp.segments
            detail = ", ".join(f"{s.src_offset}->{s.dst_offset} ({s.length} B)" for s in segs[:4])
            more = f", ... {len(segs) - 4} more" if len(segs) > 4 else ""
            lines.append(
                f"    p{pp.prefill_rank}->d{pp.decode_rank} {_heads(pp.heads)}:"
                f" {len(segs)} write(s)/page: {detail}{more}"
            )
        per_rank = ", ".join(f"d{d}={n}" for d, n in enumerate(self.writes_per_page))
        lines.append(f"  writes per page per layer: {per_rank} (total {sum(self.writes_per_page)})")
        return "\n".join(lines)


def _heads(r: range) -> str:
    return f"head {r.start}" if len(r) == 1 else f"heads {r.start}-{r.stop - 1}"


def _count(name: str, value: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ShardPlanError(f"{name} must be a non-negative integer, got {value!r}")
    return value


def _pair_segments(src: ShardSpec, p: int, dst: ShardSpec, d: int, heads: range) -> tuple[Segment, ...]:
    g = src.geometry
    s0, d0 = src.heads_of(p).start, dst.heads_of(d).start
    if g.layout == "HND":
        # A head's page_size tokens are contiguous: the piece is the whole head.
        unit = g.page_size * g.head_dim * g.elem_size
        pieces = [(dst.offset(kv, h - d0, 0), src.offset(kv, h - s0, 0)) for kv in range(g.kv_parts) for h in heads]
    else:
        unit = g.head_dim * g.elem_size
        pieces = [
            (dst.offset(kv, h - d0, t), src.offset(kv, h - s0, t))
            for kv in range(g.kv_parts)
            for t in range(g.page_size)
            for h in heads
        ]
    pieces.sort()
    merged: list[list[int]] = []  # [src, dst, length]
    for dst_off, src_off in pieces:
        last = merged[-1] if merged else None
        if last and last[0] + last[2] == src_off and last[1] + last[2] == dst_off:
            last[2] += unit
        else:
            merged.append([src_off, dst_off, unit])
    return tuple(Segment(s, t, n) for s, t, n in merged)


def check_compatible(prefill: ShardSpec, decode: ShardSpec) -> None:
    """Raise ShardPlanError naming the mismatch if these two sides cannot be planned together.

    Each ShardSpec already refused its own TP degree if it cannot split its heads; what is left
    is that both sides describe the same cache.
    """
    a, b = prefill.geometry, decode.geometry
    diffs = [
        f"{name} {getattr(a, name)!r} (prefill) != {getattr(b, name)!r} (decode)"
        for name in ("num_kv_heads", "head_dim", "page_size", "dtype", "layout", "replicated", "kv_parts")
        if getattr(a, name) != getattr(b, name)
    ]
    if diffs:
        raise ShardPlanError(
            f"prefill tp={prefill.tp} and decode tp={decode.tp} disagree on the KV cache: " + "; ".join(diffs)
        )


def plan_specs(prefill: ShardSpec, decode: ShardSpec) -> ShardPlan:
    """Plan from the two sides' specs (as exchanged in the handshake)."""
    check_compatible(prefill, decode)
    return plan_transfers(prefill.tp, decode.tp, prefill.geometry)


@functools.lru_cache(maxsize=64, typed=True)
def plan_transfers(prefill_tp: int, decode_tp: int, geometry: KVGeometry) -> ShardPlan:
    """Build the plan; raises ShardPlanError naming a TP degree that cannot split the heads."""
    if not isinstance(geometry, KVGeometry):
        raise ShardPlanError(f"geometry must be a KVGeometry, got {type(geometry).__name__}")
    # Build both sides before raising, so one error names every side that cannot be served.
    specs, problems = [], []
    for tp, role in ((prefill_tp, "prefill"), (decode_tp, "decode")):
        try:
            specs.append(ShardSpec(tp, geometry, role=role))
        except ShardPlanError as e:
            problems.append(str(e))
    if problems:
        raise ShardPlanError("; ".join(problems))
    src, dst = specs
    pairs = []
    for p in range(src.tp):
        for d in range(dst.tp):
            a, b = src.heads_of(p), dst.heads_of(d)
            heads = range(max(a.start, b.start), min(a.stop, b.stop))
            if heads:
                pairs.append(PairPlan(p, d, heads, _pair_segments(src, p, dst, d, heads)))
    # Counts from source set 0; every set has the same shape (spec docstring), so any seed agrees.
    set0 = src.replica_sets[0]
    by_pair = {(pp.prefill_rank, pp.decode_rank): len(pp.segments) for pp in pairs}
    writes = tuple(sum(by_pair.get((p, d), 0) for p in set0) for d in range(dst.tp))
    return ShardPlan(src, dst, tuple(pairs), writes)
