"""Bounds on the HTTP port's connections: a client that connects and sends nothing, or keeps an
idle keep-alive connection, must not hold a file descriptor forever (19,990 idle connections
were held before this existed).

aiohttp bounds keep-alive idleness (``keepalive_timeout``) but not a connection that never sends
its first request, nor the number of connections. A reaper task looks at the server's
connections twice a second: one with no request in progress for ``idle_timeout_s`` is closed,
and beyond ``max_connections`` the idle ones are closed oldest first. A connection with a
request in flight (a long stream included) is never touched.
"""

from __future__ import annotations

import asyncio
import logging
import time

log = logging.getLogger(__name__)
PERIOD_S = 0.5


def _busy(handler) -> bool:
    # NOTE: aiohttp keeps the request being handled here (RequestHandler._current_request)
    return getattr(handler, "_current_request", None) is not None


class ConnectionReaper:
    def __init__(self, server, idle_timeout_s: float, max_connections: int):
        """``server``: the aiohttp low-level Server (AppRunner.server)."""
        self.server, self.idle_timeout_s, self.max_connections = server, idle_timeout_s, max_connections
        self._idle_since: dict[int, float] = {}
        self._task: asyncio.Task | None = None
        self.closed_idle = 0

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(PERIOD_S)
            try:
                self.sweep()
            except Exception as e:  # noqa: BLE001 - the reaper must keep running
                log.warning("http connection reaper: %s", e)

    def sweep(self, now: float | None = None) -> int:
        now = time.monotonic() if now is None else now
        conns = list(self.server.connections)
        seen, idle = set(), []
        for h in conns:
            seen.add(id(h))
            if _busy(h):
                self._idle_since.pop(id(h), None)
                continue
            since = self._idle_since.setdefault(id(h), now)
            idle.append((since, h))
        for k in [k for k in self._idle_since if k not in seen]:
            del self._idle_since[k]
        idle.sort(key=lambda x: x[0])
        over = max(0, len(conns) - self.max_connections)
        closed = 0
        for since, h in idle:
            if now - since >= self.idle_timeout_s or closed < over:
                h.force_close()
                self._idle_since.pop(id(h), None)
                closed += 1
        if closed:
            self.closed_idle += closed
            log.info("http: closed %d idle connection(s) (server.idle_timeout_s %s, server.max_connections %d; "
                     "%d open)", closed, self.idle_timeout_s, self.max_connections, len(conns) - closed)
        return closed
