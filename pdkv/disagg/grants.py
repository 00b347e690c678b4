"""Narrow grants: a prefill peer may write only the pages (and the hidden-state row) reserved
for the requests it was sent, and only while they are reserved.

The decode node grants at PREFILL (before the message leaves) and revokes when the slot ends —
only once no write of it can land any more (every expected write landed, the peer reported
what it posted and those landed, or its data connection was torn down), and before the pages
or the row go to anyone else. A write outside a live grant is refused by the receiver before a
byte lands (pdkv._messenger grant_range). Ranges are region offsets, the ones writes use: page
``p`` of layer ``l`` is ``[l * layer_nbytes + p * page_nbytes, + page_nbytes)``; consecutive
page ids coalesce into one range per layer.

verbs: RDMA has nothing finer than a memory region, and a per-range region would be one MR per
(layer, run of pages) with its own key that every write would have to name; the verbs transport
is run with a protection domain per peer instead (only connected peers can write; see
pdkv/messenger.py), and its grants stay whole-region (``narrow=False``).
"""

from __future__ import annotations

from dataclasses import dataclass

from pdkv._messenger import RegionBusyError


@dataclass(frozen=True)
class Range:
    key: int
    offset: int
    length: int


def page_runs(pages) -> list[tuple[int, int]]:
    """Distinct page ids as (first, count) runs of consecutive ids."""
    runs: list[tuple[int, int]] = []
    for p in sorted(set(int(x) for x in pages)):
        if runs and runs[-1][0] + runs[-1][1] == p:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((p, 1))
    return runs


class RequestGrants:
    def __init__(self, messenger, kv_keys: list[int], geometry, hidden_key: int, hidden_nbytes: int,
                 narrow: bool = True):
        self.m, self.kv_keys, self.g = messenger, list(kv_keys), geometry
        self.hidden_key, self.hidden_nbytes, self.narrow = hidden_key, hidden_nbytes, narrow

    def ranges(self, pages, hidden_row: int | None) -> list[Range]:
        """``hidden_row`` None: the pages only (a region without a hidden-state row)."""
        out = [] if hidden_row is None else [Range(self.hidden_key, hidden_row * self.hidden_nbytes,
                                                   self.hidden_nbytes)]
        for key in self.kv_keys:
            for layer in range(self.g.num_layers):
                base = layer * self.g.layer_nbytes
                out += [Range(key, base + first * self.g.page_nbytes, count * self.g.page_nbytes)
                        for first, count in page_runs(pages)]
        return out

    def grant(self, peer: int, pages, hidden_row: int | None) -> list[Range]:
        """Grant ``peer`` the request's ranges (none when not narrow); on an error the ones
        already granted are revoked and the error raised."""
        if not self.narrow:
            return []
        done: list[Range] = []
        try:
            for r in self.ranges(pages, hidden_row):
                self.m.grant_range(r.key, peer, r.offset, r.length)
                done.append(r)
        except BaseException:
            self.revoke(peer, done)
            raise
        return done

    def revoke(self, peer: int, ranges: list[Range]) -> list[Range]:
        """Revoke ``ranges``; returns those still busy (a write the grant allowed is landing
        right now: retry them shortly, and keep the pages until they are gone)."""
        busy = []
        for r in ranges:
            try:
                self.m.revoke_range(r.key, peer, r.offset, r.length)
            except RegionBusyError:
                busy.append(r)
        return busy
