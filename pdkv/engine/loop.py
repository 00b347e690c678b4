"""The engine thread: one loop that owns an LLMEngine and drains one queue of typed commands.

Every role runs this loop; what differs between colocated, prefill and decode serving is the
engine's KV connector (pdkv/engine/connector.py) and who sends the commands::

    any thread ──put(AddRequest | AbortRequest | RemoteKVReady | FailRequest |
                     ReleasePages | PrefillHere | Wake | Stop)─────────────────────────────────┐
                                                                                 ▼
    engine thread:  admit → apply commands (block when there is no work) → admit → step
                      │                                                            │
                      └──────── events.on_* (on the engine thread) ◄───────────────┘

AddRequest submits the request to the scheduler's ``pending`` queue (pdkv/engine/scheduler.py);
``LLMEngine.admit`` admits from it in the scheduler policy's order. A request whose pages or
connector resources are not free (the connector answers NOT_YET) waits at the head and is tried
again after every batch of commands and every step (a release, an abort, a finished request or
a Wake may have freed what it needs); a refused one is failed here (``events.on_failed``).

``events`` (a LoopEvents) is how the front-end hears back: the HTTP server fans outputs out to
its clients (server/async_engine.py), a prefill node's coordinator turns them into DONE_AT /
FAIL / CANCEL_ACK (pdkv/disagg/prefill.py). Its methods run on the engine thread and must only
post to their own thread (``loop.call_soon_threadsafe``).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass

from pdkv.engine.params import SamplingParams
from pdkv.engine.request import RequestOutput
from pdkv.gpu import sm_split  # no CUDA import unless a green split is active

log = logging.getLogger(__name__)


# A safety net only: every resource admission waits for is given back with a command (pages by
# the engine itself, hidden-state rows with Wake), so a waiting request is retried at once.
ADMISSION_RETRY_S = 0.5

class EngineFailure(RuntimeError):
    """The engine could not run a request (refused at admission, its KV transfer failed, or a
    step raised); the request was aborted and its pages freed or held until no transfer can
    touch them. ``status``: the HTTP status it maps to (503 + ``retry_after`` s: try again later,
    e.g. no prefill node is connected right now)."""

    def __init__(self, message: str, status: int = 500, retry_after: int | None = None):
        super().__init__(message)
        self.status, self.retry_after = status, retry_after


# ---- commands: small frozen dataclasses, one handler each (EngineLoop._handlers) --------------
@dataclass(frozen=True)
class AddRequest:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival: float  # time.perf_counter() when it reached this node
    priority: int = 0  # scheduler.policy priority (lower first); validated by the front-end


@dataclass(frozen=True)
class AbortRequest:
    """The client is gone (or the peer cancelled): stop and free, holding pages a transfer may
    still touch (LLMEngine.in_transfer) until ReleasePages."""

    request_id: str


@dataclass(frozen=True)
class RemoteKVReady:
    """Every remote write of the request's KV landed: its decode can be scheduled."""

    request_id: str
    # echo + logprobs: the prompt's TokenLogprobs the prefill node computed (None: not asked)
    prompt_logprobs: list | None = None


@dataclass(frozen=True)
class FailRequest:
    """The request's KV transfer failed: the client gets ``reason``; its pages are held (a write
    may still land) until ReleasePages."""

    request_id: str
    reason: str
    status: int = 500  # what the client's HTTP answer says (EngineFailure.status)
    retry_after: int | None = None


@dataclass(frozen=True)
class ReleasePages:
    """No transfer can touch the request's held pages any more: free them."""

    request_id: str


@dataclass(frozen=True)
class PrefillHere:
    """The request's remote prefill was given up (its prefill node died; no write of it can
    land any more): its prompt is computed here instead, into the pages it holds."""

    request_id: str


@dataclass(frozen=True)
class Wake:
    """Another thread gave back a per-request resource (a hidden-state row, pdkv/disagg/rows.py):
    requests waiting for admission may fit now."""


@dataclass(frozen=True)
class Stop:
    pass


class LoopEvents:
    """What the engine loop tells its front-end, on the engine thread (no-ops by default)."""

    def on_added(self, cmd: AddRequest) -> None:
        """The loop took the request (admission may still wait for resources)."""

    def on_failed(self, request_id: str, error: EngineFailure) -> None:
        """The request ended without output: refused, its transfer failed, or a step raised."""

    def on_aborted(self, request_id: str) -> None:
        """An AbortRequest ended a request the loop knew (queued or admitted)."""

    def on_step(self, step_start: float, outputs: list[RequestOutput]) -> None:
        """A step ran (``step_start``: time.perf_counter() before it) and produced ``outputs``.
        The final output of a request that on_failed / on_aborted already ended comes here too
        (finish_reason "error" / "abort"); a front-end that ended it ignores it."""

    def on_commands_applied(self) -> None:
        """A batch of commands was applied (a good moment to copy the engine's stats)."""


class EngineLoop:
    """Runs ``engine`` on one daemon thread; ``put`` is called from any thread."""

    def __init__(self, engine, events: LoopEvents, name: str = "pdkv-engine", max_waiting: int = 4096):
        """``max_waiting``: requests that may wait for admission at once; one more is failed at
        once with a 503 (Retry-After) instead of queueing without bound."""
        self.engine, self.events = engine, events
        self.max_waiting = max_waiting
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._known: set[str] = set()  # request ids queued or admitted, not yet finished
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._stopped = threading.Event()
        self.num_step_errors = 0
        self._handlers = {AddRequest: self._on_add, AbortRequest: self._on_abort, RemoteKVReady: self._on_ready,
                          FailRequest: self._on_fail, ReleasePages: self._on_release, PrefillHere: self._on_here,
                          Wake: lambda cmd: None}  # the loop admits after every batch of commands

    def attach(self, events: LoopEvents) -> None:
        """Make ``events`` the loop's front-end, before ``start``: the server makes the loop of
        every role and the role's front-end attaches (the AsyncEngine, or a prefill node's
        coordinator)."""
        self.events = events

    # ---- any thread ------------------------------------------------------------------------------
    def put(self, cmd) -> None:
        self._commands.put(cmd)

    def start(self) -> None:
        self._thread.start()

    def is_alive(self) -> bool:
        return self._thread.is_alive()

    @property
    def stopping(self) -> bool:
        return self._stopped.is_set()

    def stop(self, timeout: float = 30.0) -> None:
        """Stop after the commands already queued; the thread aborts whatever is left."""
        self._stopped.set()
        self._commands.put(Stop())
        if self._thread.is_alive():
            self._thread.join(timeout)

    # ---- engine thread ----------------------------------------------------------------------------
    def _run(self) -> None:
        eng = self.engine
        green = None
        try:
            green = sm_split.enter_current_thread()  # parallel.gpu_sm_percent: the steps run on its SMs
            while True:
                self._admit()  # before deciding to block: a finished request may just have freed pages
                if not self._drain(block=not eng.has_work()):
                    return
                self._admit()
                if eng.has_work():
                    self._step()
        finally:
            self._fail_all(EngineFailure("the engine stopped"))
            eng.release_all()  # the loop is going away; nothing reuses the pages
            log.info("engine thread %s stopped", self._thread.name)
            del green  # NOTE: held until here: the context stays current as long as the thread steps

    def _drain(self, block: bool) -> bool:
        """Apply queued commands (waiting for one if ``block``); False once told to stop."""
        if block and self.engine.num_pending:
            # NOTE: whatever frees a resource sends a command (Wake for hidden-state rows); the
            # timeout only bounds the cost of a resource freed without one, should one appear.
            try:
                cmd = self._commands.get(timeout=ADMISSION_RETRY_S)
            except queue.Empty:
                cmd = None
        else:
            cmd = self._commands.get() if block else self._get_nowait()
        while cmd is not None:
            if isinstance(cmd, Stop):
                return False
            self._handlers[type(cmd)](cmd)
            cmd = self._get_nowait()
        self.events.on_commands_applied()
        return True

    def _get_nowait(self):
        try:
            return self._commands.get_nowait()
        except queue.Empty:
            return None

    def _on_add(self, cmd: AddRequest) -> None:
        if cmd.request_id in self._known:
            self.events.on_failed(cmd.request_id, EngineFailure(f"request id {cmd.request_id!r} is already in use"))
            return
        waiting = self.engine.num_pending
        if waiting >= self.max_waiting:
            self.events.on_failed(cmd.request_id, EngineFailure(
                f"the server is at capacity: {waiting} requests already wait for pages or other "
                f"per-request resources (server.max_waiting_requests); retry shortly", 503, 1))
            return
        self._known.add(cmd.request_id)
        self.events.on_added(cmd)
        try:
            self.engine.submit(cmd.request_id, cmd.prompt_token_ids, cmd.params, cmd.arrival, cmd.priority)
        except Exception as e:  # noqa: BLE001 - refused (or validation raced): tell the client
            self._failed(cmd.request_id, EngineFailure(str(e), getattr(e, "status", 500),
                                                      getattr(e, "retry_after", None)))

    def _admit(self) -> None:
        for rid, answer in self.engine.admit():
            self._failed(rid, EngineFailure(answer.reason, answer.status, answer.retry_after))

    def _failed(self, rid: str, error: EngineFailure) -> None:
        self._known.discard(rid)
        self.events.on_failed(rid, error)

    def _on_abort(self, cmd: AbortRequest) -> None:
        rid = cmd.request_id
        if rid not in self._known:
            return  # finished or failed already
        self._known.discard(rid)
        self.engine.abort(rid, quarantine=self.engine.in_transfer(rid))  # a queued one just leaves
        self.events.on_aborted(rid)

    def _on_ready(self, cmd: RemoteKVReady) -> None:
        if self.engine.in_transfer(cmd.request_id):  # not aborted meanwhile
            self.engine.remote_kv_ready(cmd.request_id, cmd.prompt_logprobs)

    def _on_here(self, cmd: PrefillHere) -> None:
        if self.engine.in_transfer(cmd.request_id):  # not aborted meanwhile
            self.engine.prefill_here(cmd.request_id)

    def _on_fail(self, cmd: FailRequest) -> None:
        self.engine.abort(cmd.request_id, quarantine=True, reason="error")  # a queued one just leaves
        if cmd.request_id in self._known:
            self._failed(cmd.request_id, EngineFailure(cmd.reason, cmd.status, cmd.retry_after))

    def _on_release(self, cmd: ReleasePages) -> None:
        self.engine.release(cmd.request_id)

    def _step(self) -> None:
        start = time.perf_counter()
        try:
            outputs = self.engine.step()
        except Exception as e:  # noqa: BLE001 - fail the running requests, keep serving others
            self.num_step_errors += 1
            log.exception("engine step failed; aborting %d requests", len(self._known))
            self._fail_all(EngineFailure(f"the engine failed: {type(e).__name__}: {e}"))
            return
        for out in outputs:
            if out.finished:
                self._known.discard(out.request_id)
        self.events.on_step(start, outputs)

    def _fail_all(self, error: EngineFailure) -> None:
        for rid in list(self._known):
            try:
                self.engine.abort(rid, quarantine=self.engine.in_transfer(rid))
            except Exception:  # noqa: BLE001 - keep freeing the others
                log.exception("abort of %s failed", rid)
            self.events.on_failed(rid, error)
        self._known.clear()
        try:
            self.events.on_commands_applied()
        except Exception:  # noqa: BLE001
            pass
