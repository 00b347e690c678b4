"""The decode node's engine thread: server.AsyncEngine plus remote-KV admission.

A request whose prompt has more than one token goes remote: the engine reserves pinned pages for
prompt[:-1] (when they are not free it waits in the admission queue, FIFO), and the coordinator
(on the event loop) is told the page ids so it can send PREFILL. Commands from the coordinator:
``ready`` (the KV landed: the last prompt token runs as a decode step), ``fail`` (the client gets
the error; pages go to quarantine), ``release`` (a quarantine ends: the pages return).
A client abort of a request whose KV may still be in flight also quarantines its pages.
"""

from __future__ import annotations

import logging
import time
from collections import deque

from pdkv.engine import RequestStatus
from pdkv.errors import OutOfPages
from server.async_engine import AsyncEngine, EngineFailure, _Timing

log = logging.getLogger(__name__)


class DecodeAsyncEngine(AsyncEngine):
    def __init__(self, engine, metrics, loop, coordinator):
        super().__init__(engine, metrics, loop)
        self.coordinator = coordinator
        self._admission: deque = deque()  # (rid, ids, params, arrival) waiting for free pages

    # event loop side
    def command(self, *cmd) -> None:
        self._commands.put(cmd)

    def _run(self) -> None:
        try:
            while True:
                # admit before deciding to block: a finished request may just have freed pages
                self._admit()
                if not self._drain(not self.engine.has_work()):
                    return
                self._admit()
                if self.engine.has_work():
                    self._step()
        finally:
            self._abort_all(EngineFailure("the engine stopped"))
            for rid in list(self.engine._held):
                self.engine.release(rid)  # the process is going away; nothing reuses the pages

    def _drain(self, block: bool) -> bool:
        failed: list = []
        cmd = self._commands.get() if block else self._get_nowait()
        while cmd is not None:
            kind = cmd[0]
            if kind == "stop":
                self._post(failed)
                return False
            if kind == "add":
                _, rid, ids, params, arrival = cmd
                if len(ids) <= 1 or not self.coordinator.can_route():
                    if len(ids) > 1:  # no prefill node: say so instead of silently colocating
                        failed.append((rid, EngineFailure("no prefill node is connected to this decode node")))
                        cmd = self._get_nowait()
                        continue
                    try:  # a one-token prompt never goes remote
                        self.engine.add_request(rid, ids, params)
                    except Exception as e:  # noqa: BLE001
                        failed.append((rid, EngineFailure(str(e))))
                    else:
                        self._timings[rid] = _Timing(arrival, len(ids))
                        self.metrics.prompt_tokens.inc(len(ids))
                else:
                    self._timings[rid] = _Timing(arrival, len(ids))
                    self.metrics.prompt_tokens.inc(len(ids))
                    self._admission.append((rid, ids, params, arrival))
            elif kind == "abort":
                rid = cmd[1]
                if self._timings.pop(rid, None) is not None:
                    self._client_gone(rid)
                    self.metrics.request_finished("abort")
            elif kind == "ready":
                req = self.engine.requests.get(cmd[1])
                if req is not None and req.status == RequestStatus.WAITING_FOR_REMOTE_KV:
                    self.engine.remote_kv_ready(cmd[1])
            elif kind == "fail":
                _, rid, reason = cmd
                if rid in self.engine.requests:
                    self.engine.abort(rid, quarantine=True)
                if self._timings.pop(rid, None) is not None:
                    self.metrics.request_finished("error")
                    failed.append((rid, EngineFailure(reason)))
            elif kind == "release":
                self.engine.release(cmd[1])
            cmd = self._get_nowait()
        self._post(failed)
        self.metrics.set_engine_stats(self.engine.stats())
        self.coordinator.set_pinned(self.engine.num_held_pages + sum(
            len(r.pages) for r in self.engine.scheduler.remote.values()))
        return True

    def _client_gone(self, rid: str) -> None:
        entry = next((a for a in self._admission if a[0] == rid), None)
        if entry is not None:
            self._admission.remove(entry)
            return
        req = self.engine.requests.get(rid)
        if req is not None and req.status == RequestStatus.WAITING_FOR_REMOTE_KV:
            # NOTE: a write may still land in these pages: quarantine until the peer quiesced.
            self.engine.abort(rid, quarantine=True)
            self.coordinator.post(self.coordinator.client_aborted, rid)
        else:
            self.engine.abort(rid)

    def _admit(self) -> None:
        while self._admission:
            rid, ids, params, arrival = self._admission[0]
            try:
                pages = self.engine.add_remote_request(rid, ids, params)
            except OutOfPages:
                return  # FIFO: wait for pages (a release or a finished request frees some)
            except Exception as e:  # noqa: BLE001 - validation raced; tell the client
                self._admission.popleft()
                self._timings.pop(rid, None)
                self._post([(rid, EngineFailure(str(e)))])
                continue
            self._admission.popleft()
            self.coordinator.metrics.queue_admission.observe(time.perf_counter() - arrival)
            self.coordinator.post(self.coordinator.send_prefill, rid, list(ids[:-1]), pages)

    def _note_scheduled(self, step_start: float) -> None:
        for rid, t in self._timings.items():
            if t.scheduled is not None:
                continue
            req = self.engine.requests.get(rid)
            if req is None or req.status == RequestStatus.RUNNING:
                t.scheduled = step_start
                self.metrics.queue_wait.observe(step_start - t.arrival)
