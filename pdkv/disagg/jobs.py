"""The prefill node's job table: which request is where, and when it is finished.

A job is one PREFILL from a decode node. Its state machine::

    COMPUTING ──engine done (PREFILLED | CANCELLED | FAILED)──► DRAINING ──last batch_done──► FINISHED
        │                                                                                      ▲
        └────────── engine done while no write of it is outstanding ───────────────────────────┘

COMPUTING: the engine has it (queued for admission or computing chunks); each chunk's page
writes are queued on the layer counter (``outstanding`` counts batches not yet batch_done).
DRAINING: the engine is done with it (``end`` says how) but some batch has not completed.
FINISHED: every batch completed locally, so its source pages may be reused: the table drops
it and ``answer`` is what goes back to the decode node.

NOTE: ``outstanding`` is the one field two threads write (the engine thread queues batches,
the event loop counts batch_done); it is changed only under ``JobTable.lock``. ``num_computed``
and ``t_first`` are written on the engine thread only (and read on the loop without a lock: the
load report may be a step old). Everything else is written on the event loop (and only read on
the engine thread).
"""

from __future__ import annotations

import enum
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from pdkv.disagg.messages import CancelAck, DoneAt, Fail

if TYPE_CHECKING:
    from pdkv.disagg.prefill_links import Link
    from pdkv.disagg.range_keys import RangeKeys


class DuplicateJob(KeyError):
    """A PREFILL with the id of a request still in flight on this node (the first job stays)."""


class JobState(enum.Enum):
    COMPUTING = "computing"
    DRAINING = "draining"
    FINISHED = "finished"


class JobEnd(enum.Enum):
    """How the engine was done with a job."""

    PREFILLED = "prefilled"
    CANCELLED = "cancelled"
    FAILED = "failed"


@dataclass
class Job:
    key: str  # engine request id: "<decode node id>:<req>"
    req: str  # the decode node's request id
    link: Link  # the decode node it came from
    tokens: list[int]
    dst_pages: np.ndarray  # int64 [num_pages]: the decode node's pages (for the prompt's pages skip..)
    imm: int
    hidden_off: int
    tag: int
    arrival: float
    seed: int = 0  # replica assignment (pdkv.shard.request_seed of the decode node's request id)
    state: JobState = JobState.COMPUTING
    end: JobEnd | None = None
    outstanding: int = 0  # batches queued/posted, not yet batch_done (under JobTable.lock)
    num_writes: int = 0  # queued or posted
    num_ok: int = 0  # completed locally without error: they landed or will land (what CANCEL_ACK reports)
    num_bytes: int = 0
    write_errors: int = 0
    error_reason: str = ""
    reason: str = ""
    # prompt tokens in its KV once the step now running ends (engine thread; read by the load report)
    num_computed: int = 0
    t_first: float | None = None  # first chunk queued (time.perf_counter)
    t_end: float | None = None  # end of its last forward pass (time.time, for DONE_AT)
    staging: int | None = None  # its hidden-state staging row, reserved at admission
    skip: int = 0  # leading prompt pages the decode node holds already (PREFILL cached / page size)
    num_pages_sent: int = 0  # prompt pages whose writes were queued (each once, every layer and rank)
    dst_keys: RangeKeys | None = None  # its write keys (None: the link's keys)
    shared: list | None = None  # kv_handoff share: (offset, bytes) of its pages shared (kv_share.py)
    # the speculative hand-off (pdkv/disagg/spec_handoff.py): the decode node's proposer pages,
    # one per page, and for mtp the held-back last prompt token; None without it
    next_token: int | None = None
    # echo + logprobs (pdkv/disagg/prompt_logprobs.py): top alternatives asked, and the prompt's
    # last token (the decode node's), which the forward over position n-2 scores
    prompt_logprobs: int | None = None
    last_token: int | None = None
    spec_pages: np.ndarray | None = None
    spec_keys: RangeKeys | None = None  # the proposer pages' ranges' keys (None: the link's spec_rkey)

    def write_failed(self, reason: str) -> None:
        self.write_errors += 1
        self.error_reason = reason

    def answer(self) -> DoneAt | CancelAck | Fail:
        """The message that ends the job on the decode node (once FINISHED).
        NOTE: a write that failed locally never lands; one that succeeded did or will (tcp: it
        is in the kernel; verbs: acknowledged), so the decode side waits for exactly ``posted``."""
        posted = self.num_ok
        if self.end == JobEnd.PREFILLED and not self.write_errors:
            return DoneAt(self.req, self.t_end, posted, self.num_bytes)
        if self.end == JobEnd.CANCELLED:
            return CancelAck(self.req, posted)
        reason = self.reason or (f"{self.write_errors} page write(s) failed: {self.error_reason}"
                                 if self.write_errors else "prefill failed")
        return Fail(self.req, reason, posted)


@dataclass
class JobTable:
    """Every live job, by engine key and by write tag; no threads of its own (unit-tested alone)."""

    jobs: dict[str, Job] = field(default_factory=dict)
    by_tag: dict[int, Job] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def __len__(self) -> int:
        return len(self.jobs)

    def add(self, job: Job) -> None:
        """DuplicateJob if a job with ``job.key`` is live: replacing it would orphan the first
        job (its pages never released); the table is left as it was."""
        if job.key in self.jobs:
            raise DuplicateJob(f"duplicate PREFILL: request id {job.req!r} is still in flight on this node")
        self.jobs[job.key] = job
        self.by_tag[job.tag] = job

    def get(self, key: str) -> Job | None:
        return self.jobs.get(key)

    def values(self):
        return self.jobs.values()

    # ---- engine thread -------------------------------------------------------------------------
    def queued(self, job: Job, num_batches: int) -> None:
        """``num_batches`` more batches of ``job`` are queued (or -n: that many never were)."""
        with self.lock:
            job.outstanding += num_batches

    # ---- event loop ------------------------------------------------------------------------------
    def batch_done(self, tag: int, count: int, num_errors: int, status: int, nbytes: int,
                   reason: str = "") -> Job | None:
        """One batch of the job with ``tag`` completed locally; returns the job if that finished it."""
        job = self.by_tag.get(tag)
        if job is None:
            return None
        with self.lock:
            job.outstanding -= 1
        job.num_ok += count - num_errors
        if status != 0 or num_errors:
            job.write_failed(reason or f"write failed with status {status}")
        else:
            job.num_bytes += nbytes
        return job if self._maybe_finish(job) else None

    def copy_ended(self, job: Job, error: str = "") -> Job | None:
        """One staging copy of ``job`` ended (pdkv/disagg/staged_prefill.py; its writes, if any,
        were counted first); ``error``: why it moved nothing. Returns the job if that finished it."""
        with self.lock:
            job.outstanding -= 1
        if error:
            job.write_failed(error)
        return job if job.key in self.jobs and self._maybe_finish(job) else None

    def engine_done(self, key: str, end: JobEnd, reason: str = "", t_end: float | None = None) -> Job | None:
        """The engine is done with the job (the first report counts); returns it if finished now."""
        job = self.jobs.get(key)
        if job is None or job.state != JobState.COMPUTING:
            return None
        job.state, job.end, job.t_end = JobState.DRAINING, end, t_end
        job.reason = job.reason or reason
        return job if self._maybe_finish(job) else None

    def _maybe_finish(self, job: Job) -> bool:
        with self.lock:
            busy = job.outstanding > 0
        if busy or job.state != JobState.DRAINING:
            return False
        job.state = JobState.FINISHED
        del self.jobs[job.key]
        self.by_tag.pop(job.tag, None)
        return True
