"""The staging ring: a bounded set of equal slots in one host buffer, and the byte spans copied
through them.

KV pages that cannot go straight between GPU memory and the wire (tcp, or verbs without
GPUDirect) are staged in host memory: on a prefill node a layer's pages are copied device-to-host
into one slot and the messenger posts their writes from there; on a decode node remote writes
land in a slot and are copied host-to-device. The ring is ONE allocation (pinned on a GPU host),
so the messenger registers it once: slot ``s`` is bytes ``[s.offset, s.offset + capacity)`` of
the region at ``ring.address``.

Inside a slot a job's spans are packed in order, without gaps: span ``i`` starts at
``packed_offsets(spans)[i]``. A span is a byte range of the device KV buffer (for a page of
layer ``l``: ``Span(kv.page_offset(l, page), kv.page_nbytes)``).

Slot states (one owner at a time; the generation number makes a stale handle detectable)::

    FREE --take--> HELD --(copy done, D2H)--> READY --release--> FREE
                    |  \\--(copy failed / cancelled, or H2D copy ended)------> FREE
                    \\--release (an H2D landing zone never copied in)-------> FREE
"""

from __future__ import annotations

import enum
import threading
from dataclasses import dataclass


@dataclass(frozen=True)
class Span:
    offset: int  # bytes from the start of the device (KV) buffer
    nbytes: int
    buffer: int = 0  # which of the copy engine's device buffers (tensor parallelism: the rank)


@dataclass(frozen=True)
class StagingSlot:
    """A handle on one slot, valid until it is released (``generation`` tells reuses apart)."""

    index: int
    offset: int  # bytes from ring.address
    capacity: int
    generation: int


class SlotState(enum.Enum):
    FREE = "free"
    HELD = "held"  # reserved for a job or a landing zone; a copy may be running
    READY = "ready"  # a device-to-host copy completed; the caller posts writes, then releases


def packed_offsets(spans) -> list[int]:
    """Offset of each span inside its slot (the spans are packed in order)."""
    out, at = [], 0
    for s in spans:
        out.append(at)
        at += s.nbytes
    return out


def coalesce(spans) -> list[tuple[int, Span]]:
    """Merge spans that are adjacent both in the device buffer and in the slot (consecutive pages
    of one layer): ``[(slot offset, span)]``, so a copy engine issues one copy per run."""
    runs: list[tuple[int, Span]] = []
    for at, s in zip(packed_offsets(spans), spans):
        if runs:
            prev_at, prev = runs[-1]
            if (prev.buffer == s.buffer and prev.offset + prev.nbytes == s.offset
                    and prev_at + prev.nbytes == at):
                runs[-1] = (prev_at, Span(prev.offset, prev.nbytes + s.nbytes, s.buffer))
                continue
        runs.append((at, s))
    return runs


def split_spans(spans, capacity: int) -> list[tuple[Span, ...]]:
    """Cut a list of spans (e.g. one layer's pages) into jobs that each fit one slot; a span is
    never split (a page larger than a slot is a configuration error, refused here)."""
    jobs: list[tuple[Span, ...]] = []
    cur: list[Span] = []
    used = 0
    for s in spans:
        if s.nbytes > capacity:
            raise ValueError(f"a span of {s.nbytes} bytes does not fit a staging slot of {capacity} bytes "
                             "(the slot must hold at least one page)")
        if used + s.nbytes > capacity:
            jobs.append(tuple(cur))
            cur, used = [], 0
        cur.append(s)
        used += s.nbytes
    if cur:
        jobs.append(tuple(cur))
    return jobs


class StagingRing:
    """``num_slots`` slots of ``slot_nbytes`` in ``buffer`` (a flat uint8 torch tensor, or None:
    allocate one on the CPU, pinned when ``pin``). Thread-safe."""

    def __init__(self, num_slots: int, slot_nbytes: int, buffer=None, pin: bool = False):
        import torch

        if num_slots < 1 or slot_nbytes < 1:
            raise ValueError(f"StagingRing: num_slots and slot_nbytes must be >= 1, got {num_slots}, {slot_nbytes}")
        self.num_slots, self.slot_nbytes = num_slots, slot_nbytes
        self.nbytes = num_slots * slot_nbytes
        if buffer is None:
            buffer = torch.empty(self.nbytes, dtype=torch.uint8, pin_memory=pin)
        if buffer.dtype != torch.uint8 or buffer.dim() != 1 or buffer.numel() < self.nbytes:
            raise ValueError(f"StagingRing: buffer must be a flat uint8 tensor of >= {self.nbytes} bytes, "
                             f"got {buffer.dtype} {tuple(buffer.shape)}")
        if buffer.device.type != "cpu":
            raise ValueError(f"StagingRing: the staging buffer must be host memory, got {buffer.device}")
        self.buffer = buffer
        self.address = buffer.data_ptr()  # what the messenger registers (one region)
        self._lock = threading.Lock()
        self._state = [SlotState.FREE] * num_slots
        self._generation = [0] * num_slots
        self._owner: list[str | None] = [None] * num_slots
        self._free = list(range(num_slots - 1, -1, -1))  # a stack: the warmest slot is reused first

    @property
    def num_free(self) -> int:
        with self._lock:
            return len(self._free)

    def owners(self) -> dict[int, tuple[SlotState, str | None]]:
        """Slots not FREE: index -> (state, request id). Empty when nothing leaked."""
        with self._lock:
            return {i: (st, self._owner[i]) for i, st in enumerate(self._state) if st is not SlotState.FREE}

    def take(self, request_id: str) -> StagingSlot | None:
        with self._lock:
            if not self._free:
                return None
            i = self._free.pop()
            self._state[i], self._owner[i] = SlotState.HELD, request_id
            self._generation[i] += 1
            return StagingSlot(i, i * self.slot_nbytes, self.slot_nbytes, self._generation[i])

    def mark_ready(self, slot: StagingSlot) -> None:
        with self._lock:
            self._check(slot, (SlotState.HELD,))
            self._state[slot.index] = SlotState.READY

    def give_back(self, slot: StagingSlot, allowed=(SlotState.HELD, SlotState.READY)) -> None:
        with self._lock:
            self._check(slot, allowed)
            self._state[slot.index], self._owner[slot.index] = SlotState.FREE, None
            self._free.append(slot.index)

    def state(self, slot: StagingSlot) -> SlotState:
        with self._lock:
            if self._generation[slot.index] != slot.generation:
                return SlotState.FREE  # that use of the slot is over
            return self._state[slot.index]

    def view(self, slot: StagingSlot, nbytes: int | None = None):
        """The slot's bytes as a uint8 tensor (no copy)."""
        return self.buffer[slot.offset: slot.offset + (slot.capacity if nbytes is None else nbytes)]

    def _check(self, slot: StagingSlot, allowed) -> None:
        if not 0 <= slot.index < self.num_slots or slot.offset != slot.index * self.slot_nbytes:
            raise ValueError(f"{slot} is not a slot of this ring")
        if self._generation[slot.index] != slot.generation or self._state[slot.index] not in allowed:
            raise ValueError(f"staging slot {slot.index} (generation {slot.generation}) is "
                             f"{self._state[slot.index].value} at generation {self._generation[slot.index]}: "
                             "released twice, or released while its copy runs")


# ---- what the copy engine (pdkv.gpu.copy_engine) reports per job ----

class Direction(enum.Enum):
    DEVICE_TO_HOST = "device-to-host"
    HOST_TO_DEVICE = "host-to-device"


class CopyStatus(enum.Enum):
    DONE = "done"
    FAILED = "failed"
    CANCELLED = "cancelled"


@dataclass(frozen=True)
class CopyResult:
    request_id: str
    direction: Direction
    status: CopyStatus
    slot: StagingSlot | None  # D2H DONE: the READY slot to post from, then release(); else None
    spans: tuple[Span, ...]
    nbytes: int  # bytes the job moves (packed in the slot from offset 0)
    error: str = ""
    tag: object = None  # the caller's token, handed back unchanged
