"""The engine on its own thread, talking to the asyncio event loop without blocking it.

One thread owns the engine: it is the only caller of ``add_request``, ``abort`` and ``step``.
Handlers talk to it through a thread-safe command queue that the thread drains before every
step; when no request is unfinished it blocks on that queue (no busy loop). Each step's outputs
go back to the event loop in one ``loop.call_soon_threadsafe`` call, which fans them out to
per-request sinks (asyncio queues), so the loop never waits on the engine and the engine never
waits on a slow client.

Latency metrics are taken on the engine thread, where the tokens are produced: the time a
token reaches the client's socket adds only the event loop's own delay.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from dataclasses import dataclass

from server.metrics import ServerMetrics

log = logging.getLogger(__name__)


class EngineFailure(RuntimeError):
    """The engine raised while running a request; the request was aborted and its pages freed."""


@dataclass
class _Timing:
    arrival: float  # time.perf_counter() when the HTTP request arrived
    num_prompt_tokens: int
    scheduled: float | None = None
    first_token: float | None = None
    last_token: float | None = None


class AsyncEngine:
    """Runs ``engine`` on a daemon thread; ``submit``/``abort`` are called from the event loop.

    Outputs for request ``rid`` arrive in ``sink`` as ``(tag, RequestOutput)``; if the engine
    fails the request, ``(tag, EngineFailure)`` arrives instead and nothing more follows.
    """

    def __init__(self, engine, metrics: ServerMetrics, loop: asyncio.AbstractEventLoop):
        self.engine = engine
        self.metrics = metrics
        self.loop = loop
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._sinks: dict[str, tuple[asyncio.Queue, object]] = {}  # loop thread only
        self._timings: dict[str, _Timing] = {}  # engine thread only
        self._thread = threading.Thread(target=self._run, name="pdkv-engine", daemon=True)
        self._stopped = threading.Event()
        self.num_step_errors = 0

    # ---- event loop side -------------------------------------------------------------------
    def start(self) -> None:
        self.metrics.set_engine_stats(self.engine.stats())
        self._thread.start()

    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def submit(self, rid: str, prompt_token_ids: list[int], params, sink: asyncio.Queue, tag: object,
               arrival: float) -> None:
        """Queue a request that the handler already validated (``engine.validate_request``)."""
        if self._stopped.is_set():
            raise EngineFailure("the engine is shutting down")
        self._sinks[rid] = (sink, tag)
        self._commands.put(("add", rid, prompt_token_ids, params, arrival))

    def abort(self, rid: str) -> None:
        """Stop generating for ``rid`` and free its pages; a no-op if it already finished."""
        if self._sinks.pop(rid, None) is not None:
            self._commands.put(("abort", rid))

    def stop(self, timeout: float = 30.0) -> None:
        """Abort everything, stop the thread and wait for it."""
        for rid in list(self._sinks):
            self.abort(rid)
        self._stopped.set()
        self._commands.put(("stop",))
        self._thread.join(timeout)

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

    # ---- engine thread ---------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while True:
                block = not self.engine.has_unfinished()
                if not self._drain(block):
                    return
                if self.engine.has_unfinished():
                    self._step()
        finally:
            self._abort_all(EngineFailure("the engine stopped"))
            log.info("engine thread stopped")

    def _drain(self, block: bool) -> bool:
        """Apply queued commands (waiting for one if ``block``); False once told to stop."""
        failed: list[tuple[str, object]] = []
        cmd = self._commands.get() if block else self._get_nowait()
        while cmd is not None:
            if cmd[0] == "stop":
                self._post(failed)
                return False
            if cmd[0] == "add":
                _, rid, ids, params, arrival = cmd
                try:
                    self.engine.add_request(rid, ids, params)
                except Exception as e:  # noqa: BLE001 - e.g. a race with validation; tell the client
                    failed.append((rid, EngineFailure(str(e))))
                else:
                    self._timings[rid] = _Timing(arrival, len(ids))
                    self.metrics.prompt_tokens.inc(len(ids))
            elif cmd[0] == "abort":
                if self._timings.pop(cmd[1], None) is not None:
                    self.engine.abort(cmd[1])
                    self.metrics.request_finished("abort")
            cmd = self._get_nowait()
        self._post(failed)
        self.metrics.set_engine_stats(self.engine.stats())
        return True

    def _get_nowait(self):
        try:
            return self._commands.get_nowait()
        except queue.Empty:
            return None

    def _step(self) -> None:
        start = time.perf_counter()
        try:
            outputs = self.engine.step()
        except Exception as e:  # noqa: BLE001 - fail the running requests, keep serving others
            self.num_step_errors += 1
            log.exception("engine step failed; aborting %d requests", len(self._timings))
            self._abort_all(EngineFailure(f"the engine failed: {type(e).__name__}: {e}"))
            return
        now = time.perf_counter()
        self._note_scheduled(start)
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
                else:
                    for _ in range(n):
                        self.metrics.inter_token_latency.observe((now - t.last_token) / n)
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
        """Observe queue wait for requests that this step scheduled for the first time.

        A request counts as scheduled once the engine moved it to RUNNING (a prefill chunk of it
        ran); an engine without per-request states counts the first step after admission.
        """
        requests = getattr(self.engine, "requests", None)
        for rid, t in self._timings.items():
            if t.scheduled is not None:
                continue
            req = requests.get(rid) if isinstance(requests, dict) else None
            status = getattr(getattr(req, "status", None), "value", "running")
            if req is None or status != "waiting":
                t.scheduled = step_start
                self.metrics.queue_wait.observe(step_start - t.arrival)

    def _abort_all(self, error: Exception) -> None:
        items = []
        for rid in list(self._timings):
            try:
                self.engine.abort(rid)
            except Exception:  # noqa: BLE001 - keep freeing the others
                log.exception("abort of %s failed", rid)
            self.metrics.request_finished("error")
            items.append((rid, error))
        self._timings.clear()
        self._post(items)
        try:
            self.metrics.set_engine_stats(self.engine.stats())
        except Exception:  # noqa: BLE001
            pass

    def _post(self, items: list[tuple[str, object]]) -> None:
        if items and not self.loop.is_closed():
            try:
                self.loop.call_soon_threadsafe(self._dispatch, items)
            except RuntimeError:
                pass  # the loop closed between the check and the call; nobody is listening
