"""The keys a prefill node names in its writes of one request: one per granted range.

The decode node grants a request's pages per (decode rank, layer, run of consecutive pages)
and sends each range's write key with PREFILL (pdkv/disagg/grants.py ``write_keys``: a
pdkv/disagg/messages.py ``GrantKeys``). On tcp they are all the region's key; on verbs each is
the rkey of that range's own MR, so every write must
name the key of the range it falls in — a write under another range's key (or after the range
was revoked) is refused by the NIC and breaks the connection. ``split`` / ``groups`` split a
chunk's destination pages by key, so each page batch (pdkv/disagg/writes.py) uses one key.

The speculative hand-off's proposer pages are granted the same way (one rank, the proposer's
layers, no hidden row) and come as ``spec_runs``/``spec_rkeys`` (pdkv/disagg/spec_handoff.py).

A PREFILL whose keys do not cover its pages is refused (ValueError naming what is missing),
never half-written.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class RangeKeys:
    firsts: np.ndarray  # int64 [runs]: first page of each run, ascending
    counts: np.ndarray  # int64 [runs]
    keys: list  # [decode rank][layer][run] -> int (nested lists: indexed per batch, on the engine thread)
    hidden: int  # the hidden-state row's write key
    uniform: bool  # every run of a (rank, layer) has the same key (tcp): one batch per layer

    @classmethod
    def parse(cls, msg: dict, pages: np.ndarray, ranks: int, layers: int, *, runs_field: str = "runs",
              keys_field: str = "kv_rkeys", hidden_field: str | None = "hidden_rkey") -> "RangeKeys | None":
        """PREFILL's ``runs``/``kv_rkeys``/``hidden_rkey`` (None when it carries none: the link's
        region keys are used), checked against its ``pages``. The speculative hand-off's proposer
        pages come as ``spec_runs``/``spec_rkeys`` with no hidden row (``hidden_field`` None)."""
        if keys_field not in msg:
            return None
        runs, flat = msg.get(runs_field), msg.get(keys_field)
        hidden = msg.get(hidden_field) if hidden_field is not None else 0
        if (not isinstance(runs, list) or not runs or not all(
                isinstance(r, list) and len(r) == 2 and all(_uint(x, 2**31) for x in r) and r[1] > 0 for r in runs)):
            raise ValueError(f"{runs_field} must be a non-empty list of [first page, count] pairs")
        if len(runs) > len(pages):  # bounded by the request's pages, so by the pool: not by the sender
            raise ValueError(f"{runs_field}: {len(runs)} runs for {len(pages)} pages")
        firsts = np.asarray([r[0] for r in runs], dtype=np.int64)
        counts = np.asarray([r[1] for r in runs], dtype=np.int64)
        if np.any(firsts[1:] < firsts[:-1] + counts[:-1]):
            raise ValueError(f"{runs_field} must be ascending and disjoint")
        want = ranks * layers * len(runs)
        if not isinstance(flat, list) or len(flat) != want or not all(_uint(k, 2**64) for k in flat):
            raise ValueError(f"{keys_field} must be {want} keys ({ranks} decode rank(s) x {layers} layer(s) x "
                             f"{len(runs)} run(s)), got {len(flat) if isinstance(flat, list) else flat!r}"[:200])
        if not _uint(hidden, 2**64):
            raise ValueError(f"{hidden_field} must be a non-negative integer, got {hidden!r}"[:200])
        keys = np.asarray(flat, dtype=np.uint64).reshape(ranks, layers, len(runs))
        out = cls(firsts, counts, keys.tolist(), hidden, bool((keys == keys[:, :, :1]).all()))
        try:
            out.runs_of(pages)  # every page is in a granted run
        except ValueError as e:
            raise ValueError(f"{runs_field}: {e}") from None
        return out

    def runs_of(self, dst_pages: np.ndarray) -> np.ndarray:
        """The run index of each page; ValueError if one is in no run."""
        idx = np.searchsorted(self.firsts, dst_pages, side="right") - 1
        bad = (idx < 0) | (dst_pages >= self.firsts[np.maximum(idx, 0)] + self.counts[np.maximum(idx, 0)])
        if np.any(bad):
            raise ValueError(f"page {int(dst_pages[np.argmax(bad)])} is in no granted run")
        return idx

    def split(self, dst_pages: np.ndarray) -> list[tuple[int, np.ndarray | None]]:
        """(run, positions into dst_pages) per run the pages fall in (positions None: all of
        them); computed once per chunk, the keys then per (rank, layer) by ``groups``."""
        idx = self.runs_of(dst_pages)
        if self.uniform:
            return [(int(idx[0]), None)]
        runs = np.unique(idx)
        if len(runs) == 1:
            return [(int(runs[0]), None)]
        return [(int(r), np.flatnonzero(idx == r)) for r in runs]

    def groups(self, split, rank: int, layer: int) -> list[tuple[int, np.ndarray | None]]:
        """(key, positions) of the writes to decode rank ``rank``'s ``layer``, one per entry of
        ``split`` (this chunk's runs)."""
        keys = self.keys[rank][layer]
        return [(keys[r], pos) for r, pos in split]


def _uint(v, top: int) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and 0 <= v < top
