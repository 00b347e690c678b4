"""Narrow grants: a prefill peer may write only the pages (and the hidden-state row) reserved
for the requests it was sent, and only while they are reserved — on every transport.

The decode node grants at PREFILL (before the message leaves) and revokes when the slot ends —
only once no write of it can land any more (every expected write landed, the peer reported
what it posted and those landed, or its data connection was torn down), and before the pages
or the row go to anyone else. A write outside a live grant is refused before a byte lands: by
the tcp receiver (pdkv._messenger grant_range), or on verbs by the NIC. Ranges are region
offsets, the ones writes use: page ``p`` of layer ``l`` is ``[l * layer_nbytes + p *
page_nbytes, + page_nbytes)``; consecutive page ids coalesce into one range per layer.

Each grant returns the key the peer must name in writes into it (``Range.wkey``): on tcp the
region's key (the receiver checks the writer's ranges), on verbs the rkey of an MR of exactly
that range in the peer's protection domain — one MR per (rank, layer, run of pages), the RDMA
protection unit. PREFILL carries them (``write_keys``) and the prefill node's planner names, per
write, the key of the range it falls in (pdkv/disagg/range_keys.py). Registration is the cost:
``count`` MRs per request, bounded per request and per peer (messenger.max_grants_per_request,
max_grants_per_peer; decode.py refuses beyond them, naming the limit).

Where a request lands (verbs over several NICs): a verbs key names a region AND a NIC, and
grant_range makes the range's MR on the NIC its key names, so the write key it returns lands the
peer's writes through that NIC. A decode rank near several NICs gives its region's key on each
(``kv_keys[r]`` a tuple, pdkv.messenger.rank_keys): each request's ranges of rank r are granted
on the one ``pdkv.shard.pick_nic(seed, r, n)`` picks (the hidden row on rank 0's), so a TP1
decode node spreads its landings over its NICs. One NIC (an int key), tcp: unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass

from pdkv._messenger import RegionBusyError
from pdkv.disagg.messages import GrantKeys
from pdkv.shard import pick_nic


@dataclass(frozen=True)
class Range:
    key: int  # the region's key (what grant/revoke name)
    offset: int
    length: int
    wkey: int = 0  # the key the peer names in its writes into this range


def page_runs(pages) -> list[tuple[int, int]]:
    """Distinct page ids as (first, count) runs of consecutive ids."""
    runs: list[tuple[int, int]] = []
    for p in sorted(set(int(x) for x in pages)):
        if runs and runs[-1][0] + runs[-1][1] == p:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((p, 1))
    return runs


def on_nic(keys, seed: int, rank: int) -> int:
    """``keys``: one key, or a tuple of the same region's key on each NIC: the one the request's
    seed picks for ``rank``."""
    return keys if isinstance(keys, int) else keys[pick_nic(seed, rank, len(keys))]


class RequestGrants:
    def __init__(self, messenger, kv_keys: list, geometry, hidden_key, hidden_nbytes: int):
        """``kv_keys``: per rank its region's key (int) or its key on each of its NICs (tuple);
        ``hidden_key`` likewise, on rank 0's NICs."""
        self.m, self.kv_keys, self.g = messenger, list(kv_keys), geometry
        self.hidden_key, self.hidden_nbytes = hidden_key, hidden_nbytes

    def count(self, pages) -> int:
        """How many ranges (verbs: MRs) a request with ``pages`` is granted."""
        return 1 + len(self.kv_keys) * self.g.num_layers * len(page_runs(pages))

    def ranges(self, pages, hidden_row: int | None, seed: int = 0) -> list[Range]:
        """The hidden row (``hidden_row`` None: none, a region without one), then per rank
        (kv_keys order), per layer, per run: the order ``write_keys`` and pdkv/disagg/range_keys.py
        rely on. Each rank's ranges on the NIC ``seed`` picks for it (see on_nic)."""
        out = [] if hidden_row is None else [Range(on_nic(self.hidden_key, seed, 0),
                                                   hidden_row * self.hidden_nbytes, self.hidden_nbytes)]
        runs = page_runs(pages)
        for rank, keys in enumerate(self.kv_keys):
            key = on_nic(keys, seed, rank)
            for layer in range(self.g.num_layers):
                base = layer * self.g.layer_nbytes
                out += [Range(key, base + first * self.g.page_nbytes, count * self.g.page_nbytes)
                        for first, count in runs]
        return out

    def grant(self, peer: int, pages, hidden_row: int | None, seed: int = 0) -> list[Range]:
        """Grant ``peer`` the request's ranges, each with the key it must write with (on the NIC
        ``seed``, the request's seed, picks per rank); on an error the ones already granted are
        revoked and the error raised."""
        done: list[Range] = []
        try:
            for r in self.ranges(pages, hidden_row, seed):
                wkey = self.m.grant_range(r.key, peer, r.offset, r.length)
                done.append(Range(r.key, r.offset, r.length, wkey))
        except BaseException:
            self.revoke(peer, done)
            raise
        return done

    @staticmethod
    def write_keys(pages, granted: list[Range], hidden: bool = True) -> GrantKeys:
        """What PREFILL carries of ``granted`` (the ranges of ``pages``, in ``ranges`` order): the
        runs, the write key of each (rank, layer, run) range, and the hidden row's write key
        (``hidden`` False: the speculative hand-off's proposer pages, granted without a row)."""
        runs = tuple(page_runs(pages))
        if not hidden:
            return GrantKeys(runs, tuple(r.wkey for r in granted))
        return GrantKeys(runs, tuple(r.wkey for r in granted[1:]), granted[0].wkey)

    def revoke(self, peer: int, ranges: list[Range]) -> list[Range]:
        """Revoke ``ranges``; returns those still busy (a write the grant allowed is landing
        right now: retry them shortly, and keep the pages until they are gone). On verbs the
        MR is deregistered: after that the NIC refuses every write through its key."""
        busy = []
        for r in ranges:
            try:
                self.m.revoke_range(r.key, peer, r.offset, r.length)
            except RegionBusyError:
                busy.append(r)
        return busy
