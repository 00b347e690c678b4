"""The HTTP server's front-end to the engine thread, without blocking the asyncio event loop.

One thread owns the engine (pdkv.engine.loop.EngineLoop, the same loop on every role): handlers
send it typed commands (AddRequest, AbortRequest) through its queue; when nothing can run it
blocks on that queue (no busy loop). Each step's outputs come back to the event loop in one
``loop.call_soon_threadsafe`` call, which fans them out to per-request sinks (asyncio queues),
so the loop never waits on the engine and the engine never waits on a slow client. This module
knows nothing about roles: a disaggregated node's connector and coordinator plug into the
engine and its loop, not into this front-end.

Latency metrics are taken on the engine thread, where the tokens are produced: the time a
token reaches the client's socket adds only the event loop's own delay.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

from pdkv.engine.loop import AbortRequest, AddRequest, EngineFailure, EngineLoop, LoopEvents
from pdkv.engine.request import RequestStatus
from pdkv.server.metrics import ServerMetrics

log = logging.getLogger(__name__)


@dataclass
class _Timing:
    arrival: float  # time.perf_counter() when the HTTP request arrived
    num_prompt_tokens: int
    scheduled: float | None = None
    first_token: float | None = None
    last_token: float | None = None


class AsyncEngine(LoopEvents):
    """The HTTP server's front-end to the engine loop (pdkv.engine.loop.EngineLoop): ``submit`` /
    ``abort`` are called from the event loop; the LoopEvents methods run on the engine thread.

    Outputs for request ``rid`` arrive in ``sink`` as ``(tag, RequestOutput)``; if the engine
    fails the request, ``(tag, EngineFailure)`` arrives instead and nothing more follows.
    ``commands`` (EngineLoop.put) is what a node's coordinator uses to send its own commands
    (RemoteKVReady, FailRequest, ReleasePages) to the same loop.
    """

    def __init__(self, engine, metrics: ServerMetrics, loop: asyncio.AbstractEventLoop, engine_loop: EngineLoop):
        """``engine_loop``: the server's, not started yet; this front-end attaches to it."""
        self.engine = engine
        self.metrics = metrics
        self.loop = loop
        self._engine_loop = engine_loop
        engine_loop.attach(self)
        self.commands = engine_loop.put
        self._sinks: dict[str, tuple[asyncio.Queue, object]] = {}  # loop thread only
        self._timings: dict[str, _Timing] = {}  # engine thread only
        self._stopped = False

    @property
    def num_step_errors(self) -> int:
        return self._engine_loop.num_step_errors

    # ---- event loop side -------------------------------------------------------------------
    def is_alive(self) -> bool:
        return self._engine_loop.is_alive()

    @property
    def num_in_flight(self) -> int:
        """Requests submitted and not yet finished or aborted (the node's /load)."""
        return len(self._sinks)

    def submit(self, rid: str, prompt_token_ids: list[int], params, sink: asyncio.Queue, tag: object,
               arrival: float, priority: int = 0) -> None:
        """Queue a request that the handler already validated (``engine.validate_request``)."""
        if self._stopped:
            raise EngineFailure("the engine is shutting down")
        self._sinks[rid] = (sink, tag)
        self.commands(AddRequest(rid, prompt_token_ids, params, arrival, priority))

    def abort(self, rid: str) -> None:
        """Stop generating for ``rid`` and free its pages; a no-op if it already finished."""
        if self._sinks.pop(rid, None) is not None:
            self.commands(AbortRequest(rid))

    def close(self) -> None:
        """Abort every request of a client and take no new one (the server then stops the loop)."""
        for rid in list(self._sinks):
            self.abort(rid)
        self._stopped = True

    def _dispatch(self, items: list[tuple[str, object]]) -> None:
        # Runs on the event loop: hand each output to its request's sink.
        for rid, item in items:
            entry = self._sinks.get(rid)
            if entry is None:
                continue  # aborted by its handler meanwhile
            sink, tag = entry
            sink.put_nowait((tag, item))
            if isinstance(item, Exception) or item.finished:
                del self._sinks[rid]

    # ---- engine thread (LoopEvents) ----------------------------------------------------------
    def on_added(self, cmd: AddRequest) -> None:
        self._timings[cmd.request_id] = _Timing(cmd.arrival, len(cmd.prompt_token_ids))
        self.metrics.prompt_tokens.inc(len(cmd.prompt_token_ids))

    def on_failed(self, request_id: str, error: EngineFailure) -> None:
        if self._timings.pop(request_id, None) is not None:
            self.metrics.request_finished("error")
        self._post([(request_id, error)])

    def on_aborted(self, request_id: str) -> None:
        if self._timings.pop(request_id, None) is not None:
            self.metrics.request_finished("abort")

    def on_commands_applied(self) -> None:
        self.metrics.set_engine_stats(self.engine.stats())

    def on_step(self, step_start: float, outputs) -> None:
        now = time.perf_counter()
        self._note_scheduled(step_start)
        items = []
        for out in outputs:
            t = self._timings.get(out.request_id)
            if t is None:
                continue  # aborted while this step ran
            n = len(out.new_token_ids)
            if n:
                if t.first_token is None:
                    self.metrics.time_to_first_token.observe(now - t.arrival)
                    t.first_token = now
                    self.metrics.tokens_delivered(None, n)
                else:
                    self.metrics.tokens_delivered(now - t.last_token, n)
                t.last_token = now
                self.metrics.generation_tokens.inc(n)
            if out.finished:
                self.metrics.e2e_latency.observe(now - t.arrival)
                self.metrics.request_finished(out.finish_reason)
                del self._timings[out.request_id]
            items.append((out.request_id, out))
        self.metrics.set_engine_stats(self.engine.stats())
        self._post(items)

    def _note_scheduled(self, step_start: float) -> None:
        """Observe queue wait for requests that this step scheduled for the first time: a
        request counts as scheduled once it is RUNNING (a chunk of it ran) or left the engine."""
        requests = self.engine.requests
        for rid, t in self._timings.items():
            if t.scheduled is not None:
                continue
            req = requests.get(rid)
            if req is None or req.status == RequestStatus.RUNNING:
                t.scheduled = step_start
                self.metrics.queue_wait.observe(step_start - t.arrival)

    def _post(self, items: list[tuple[str, object]]) -> None:
        if items and not self.loop.is_closed():
            try:
                self.loop.call_soon_threadsafe(self._dispatch, items)
            except RuntimeError:
                pass  # the loop closed between the check and the call; nobody is listening


__all__ = ["AsyncEngine", "EngineFailure"]
