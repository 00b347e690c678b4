"""Decode node, staged: the prefill node's writes land in staging slots, which are copied into
the KV pages before the request is declared complete (pdkv/disagg/staged.py says when).

A landing slot holds one page of every layer and rank, laid out so the prefill node's write
arithmetic is unchanged: the node advertises this geometry in its HELLO instead of its KV's
(``page_nbytes`` = the slot stride, ``layer_nbytes`` = one page) and sends one key per rank,
registered at the rank's block inside the ring::

    slot s = [rank 0: layer 0 page | layer 1 page | ...][rank 1: layer 0 | ...] ...
    rank d's key = ring + d * L * P;  (slot s, layer l) of rank d at key + s * slot + l * P

so PREFILL carries slot numbers where it carried page ids. Per request (``Landing``):

    reserve (engine thread, admit: all slots or none: the request waits, bounded by the ring)
      -> the count completes, the grants are revoked (nothing can land any more)
      -> copy_in of every slot (host to device, the copy engine); each slot is freed by the
         engine when its copy ends -> ``on_done(rid, error)`` once, when the last one ended
    or -> the request ends otherwise (timeout, FAIL, dead peer): ``release`` once no write can land.

A cancelled copy (the client left) stops between spans (CPU) or runs to its end (CUDA), so the
pages are released only after ``on_done``: never while a copy may still write them.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass

from pdkv.disagg.messages import GrantKeys
from pdkv.disagg.grants import Range, RequestGrants, on_nic, page_runs
from pdkv.disagg.staged import decode_ring_shape, make_copy_engine, make_ring, region_buffers
from pdkv.disagg.writes import Geometry
from pdkv.gpu.staging import CopyStatus, Span
from pdkv.messenger import rank_key, rank_keys

log = logging.getLogger("pdkv.disagg.decode")


@dataclass(frozen=True)
class CopyIn:
    """The decode coordinator's command once a landed request's grants are gone: copy its landing
    slots into its KV ``pages``; RemoteKVReady follows the copy, not the count."""

    rid: str
    pages: tuple


def build_landing(cfg, mode, messenger, kv, metrics) -> "Landing":
    """The decode node's ring (one slot per page of every layer and rank), its copy engine over
    every rank's KV buffer, registered per rank (``kv``: the node's unregistered NodeKV)."""
    g = kv.geometry
    num_slots, slot_nbytes = decode_ring_shape(cfg, g.page_nbytes, g.num_layers, len(kv.regions))
    ring = make_ring(num_slots, slot_nbytes, mode)
    copy = make_copy_engine(mode, ring, region_buffers(kv.regions), 0)
    log.info("decode: KV lands in %d staging slot(s) of %d KiB (%s)", num_slots, slot_nbytes >> 10, copy.name)
    metrics.staging_slots.set_function(lambda: ring.num_slots - ring.num_free)
    return Landing(copy, messenger, kv)


class Landing:
    """What the decode node offers prefill nodes when it stages: the KV-region face
    (``regions``, ``spec``, ``geometry``, ``keys``, as pdkv.disagg.sharded.NodeKV) of its ring."""

    def __init__(self, copy, messenger, kv):
        """``copy``: the copy engine over every rank's KV buffer, its ring of slots of
        ``len(kv.regions) * L * P`` bytes; ``kv``: the node's NodeKV (not registered)."""
        self.copy, self.kv = copy, kv
        self.regions, self.spec = kv.regions, kv.spec
        g = kv.geometry
        self.tp, self.num_layers, self.page_nbytes = len(kv.regions), g.num_layers, g.page_nbytes
        self.rank_nbytes = g.num_layers * g.page_nbytes  # one rank's block of a slot
        ring = copy.ring
        if ring.slot_nbytes != self.tp * self.rank_nbytes:
            raise ValueError(f"landing ring slots are {ring.slot_nbytes} bytes; one page of every layer and "
                             f"rank is {self.tp * self.rank_nbytes}")
        self.num_slots = ring.num_slots
        self.geometry = Geometry(g.num_layers, ring.slot_nbytes, g.page_nbytes)  # the write arithmetic's view
        regs = [messenger.register_address(ring.address + d * self.rank_nbytes, ring.nbytes - d * self.rank_nbytes)
                for d in range(self.tp)]
        # as NodeKV: rank d's block is keyed on rank d's NIC(s), so landings go where direct ones
        # would -- one key per rank NIC, the request's seed picks one (LandingGrants, grants.on_nic)
        self.keys = [rank_key(messenger, k, d) for d, k in enumerate(regs)]
        self.nic_keys = [rank_keys(messenger, k, d) for d, k in enumerate(regs)]
        self._lock = threading.Lock()
        self._held: dict[str, list] = {}  # rid -> its StagingSlots, reserved, not yet copying
        self._copying: dict[str, list] = {}  # rid -> [copies left, first error, on_done]
        self._landed: set[str] = set()  # every write landed, copy-in not started yet (grants being revoked)

    def hello_extra(self) -> dict:
        """The HELLO ``extra`` fields the prefill node's write arithmetic reads."""
        return {"num_layers": self.num_layers, "page_nbytes": self.geometry.page_nbytes,
                "layer_nbytes": self.geometry.layer_nbytes, "num_pages": self.num_slots}

    # ---- engine thread ----------------------------------------------------------------------
    def reserve(self, rid: str, num_pages: int) -> bool:
        """A slot per page, all or none (False: the ring is full now; the request waits)."""
        slots = []
        for _ in range(num_pages):
            s = self.copy.reserve(rid, self.copy.ring.slot_nbytes)
            if s is None:
                for t in slots:
                    self.copy.release(t)
                return False
            slots.append(s)
        with self._lock:
            self._held[rid] = slots
        return True

    # ---- event loop -------------------------------------------------------------------------
    def slots_of(self, rid: str) -> list[int]:
        with self._lock:
            return [s.index for s in self._held[rid]]

    def mark_landed(self, rid: str) -> None:
        """Every write landed; the copy-in follows once the grants are revoked. From now on the
        request counts as copying: a client that leaves must wait for the copy (or its skipping)."""
        with self._lock:
            self._landed.add(rid)

    def release(self, rid: str) -> None:
        """Give back a request's slots that were never copied (no write of it can land any more)."""
        with self._lock:
            self._landed.discard(rid)
            slots = self._held.pop(rid, ())
        for s in slots:
            self.copy.release(s)

    def copying(self, rid: str) -> bool:
        with self._lock:
            return rid in self._copying or rid in self._landed

    def copy_in(self, rid: str, pages, on_done) -> None:
        """Copy each slot into the request's KV pages (page i <- slot i); ``on_done(rid, error)``
        once every copy ended ('' when all were DONE), on the copy engine's notifier thread."""
        with self._lock:
            self._landed.discard(rid)
            slots = self._held.pop(rid)
            self._copying[rid] = [len(slots), "", on_done]
        for slot, page in zip(slots, pages):
            spans = tuple(Span(layer * self.kv.geometry.layer_nbytes + int(page) * self.page_nbytes,
                               self.page_nbytes, d) for d in range(self.tp) for layer in range(self.num_layers))
            try:
                self.copy.copy_in(slot, rid, spans, self._copied)
            except Exception as e:  # noqa: BLE001 - a closed engine: the slot is still ours
                self.copy.release(slot)
                self._ended(rid, f"staging copy refused: {e}")

    def cancel(self, rid: str) -> None:
        self.copy.cancel(rid)

    def _copied(self, result) -> None:  # notifier thread
        error = "" if result.status is CopyStatus.DONE else (result.error or f"staging copy {result.status.value}")
        self._ended(result.request_id, error)

    def _ended(self, rid: str, error: str) -> None:
        with self._lock:
            entry = self._copying[rid]
            entry[0] -= 1
            entry[1] = entry[1] or error
            if entry[0]:
                return
            del self._copying[rid]
        entry[2](rid, entry[1])

    def num_reserved(self) -> int:
        with self._lock:
            return sum(len(s) for s in self._held.values()) + len(self._copying)


class LandingGrants(RequestGrants):
    """Grants over landing slots (``pages`` here are slot numbers), plus the hidden-state row.
    One range per rank key and run of consecutive slots, covering every layer of those slots:
    rank d's writes into slot s land at d's key + s * slot + l * P (l < L), so the range runs
    from the run's first slot to its last slot's L-th page -- this request's slots only (their
    other ranks' blocks included), never a neighbour's. PREFILL still names a key per (rank,
    layer, run), as pdkv/disagg/range_keys.py reads them: a run's key, once per layer."""

    def __init__(self, messenger, landing: Landing, hidden_key, hidden_nbytes: int):
        """``hidden_key``: the hidden rows' key, or its key on each of rank 0's NICs (a tuple)."""
        super().__init__(messenger, landing.nic_keys, landing.geometry, hidden_key, hidden_nbytes)
        self.landing = landing

    def count(self, pages) -> int:
        return 1 + len(self.kv_keys) * len(page_runs(pages))

    def ranges(self, pages, hidden_row: int, seed: int = 0) -> list[Range]:
        # each rank's ranges on the NIC the request's seed picks among the rank's (as direct landings)
        out = [Range(on_nic(self.hidden_key, seed, 0), hidden_row * self.hidden_nbytes, self.hidden_nbytes)]
        slot, block = self.landing.geometry.page_nbytes, self.landing.rank_nbytes
        runs = page_runs(pages)
        for rank, keys in enumerate(self.kv_keys):
            key = on_nic(keys, seed, rank)
            out += [Range(key, first * slot, (count - 1) * slot + block) for first, count in runs]
        return out

    def write_keys(self, pages, granted: list[Range], hidden: bool = True) -> GrantKeys:
        runs = page_runs(pages)
        keys = [r.wkey for r in granted[1:]]  # [rank][run]
        flat = [keys[d * len(runs) + j] for d in range(len(self.kv_keys))
                for _ in range(self.landing.num_layers) for j in range(len(runs))]
        return GrantKeys(tuple(runs), tuple(flat), granted[0].wkey)
