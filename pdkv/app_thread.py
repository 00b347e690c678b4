"""An aiohttp application served on a background thread with its own event loop.

Tests, tools and benchmarks run the HTTP server (server.ServerThread) and the router
(pdkv.router.RouterThread) in-process this way; both were the same forty lines. A subclass says
how to open its site (``_open``: an ``aiohttp.web.AppRunner`` already set up and started, and
the port it bound); this class owns the thread, the start/stop handshake and the clean-up.

``with SomeThread(...) as t: ... t.url ...``
"""

from __future__ import annotations

import asyncio
import threading

from aiohttp import web


class AppThread:
    name = "pdkv-app"  # the thread's name, as ps and py-spy show it
    what = "app"  # in the start-up timeout's message

    def __init__(self, host: str):
        self.host = host
        self.port: int | None = None
        self.app: web.Application | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)

    async def _open(self) -> tuple[web.AppRunner, int]:
        raise NotImplementedError

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout: float = 60.0):
        self._thread.start()
        if not self._ready.wait(timeout):
            raise TimeoutError(f"{self.what} did not start within {timeout} s")
        if self._error is not None:
            raise self._error
        return self

    def stop(self, timeout: float = 60.0) -> None:
        if self._loop is not None and self._stop is not None and not self._loop.is_closed():
            try:
                self._loop.call_soon_threadsafe(self._stop.set)
            except RuntimeError:  # the loop closed between the check and the call
                pass
        self._thread.join(timeout)

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def _run(self) -> None:
        async def main() -> None:
            self._loop = asyncio.get_running_loop()
            self._stop = asyncio.Event()
            try:
                runner, self.port = await self._open()
                self.app = runner.app
            except BaseException as e:  # noqa: BLE001 - reported to start()
                self._error = e
                self._ready.set()
                return
            self._ready.set()
            try:
                await self._stop.wait()
            finally:
                await runner.cleanup()

        asyncio.run(main())
