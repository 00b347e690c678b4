"""A slow pre-authentication flood for the security tests: ``per_source`` connections from each
of several loopback source addresses, each dribbling a real AUTH frame at one byte per
``byte_every_s`` and reopened when the node closes it. One thread, bounded count and time."""
from __future__ import annotations

import selectors
import socket
import threading
import time

from pdkv import auth
from pdkv.control import encode_frame

AUTH = encode_frame({"type": "AUTH", "nonce": auth.new_nonce(), "secret": True})


class SlowFlood:
    def __init__(self, port: int, sources=("127.0.0.2", "127.0.0.3", "127.0.0.4", "127.0.0.5"),
                 per_source: int = 16, byte_every_s: float = 1.0, reopen_after_s: float = 0.02):
        self.port, self.sources, self.per_source = port, sources, per_source
        self.byte_every_s, self.reopen_after_s = byte_every_s, reopen_after_s
        self.num_opened = self.num_closed_by_node = 0
        self.max_open = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="test-slow-flood", daemon=True)

    def __enter__(self) -> "SlowFlood":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(10)

    def _open(self, sel, source: str) -> None:
        s = socket.socket()
        s.bind((source, 0))
        s.setblocking(False)
        s.connect_ex(("127.0.0.1", self.port))
        sel.register(s, selectors.EVENT_READ, [source, 0, time.monotonic()])  # source, bytes sent, last
        self.num_opened += 1

    def _run(self) -> None:
        sel = selectors.DefaultSelector()
        reopen: list[tuple[float, str]] = []
        for src in self.sources:
            for _ in range(self.per_source):
                self._open(sel, src)
        try:
            while not self._stop.is_set():
                now = time.monotonic()
                for at, src in [r for r in reopen if r[0] <= now]:
                    reopen.remove((at, src))
                    self._open(sel, src)
                for key, _ in sel.select(0.02):  # readable: the node's AUTH, or its close
                    s, state = key.fileobj, key.data
                    try:
                        data = s.recv(4096)
                    except BlockingIOError:
                        continue
                    except OSError:
                        data = b""
                    if not data:
                        sel.unregister(s)
                        s.close()
                        self.num_closed_by_node += 1
                        reopen.append((now + self.reopen_after_s, state[0]))
                self.max_open = max(self.max_open, len(sel.get_map()))
                for key in list(sel.get_map().values()):  # one more byte of AUTH, never all of it
                    state = key.data
                    if now - state[2] >= self.byte_every_s and state[1] < len(AUTH) - 1:
                        try:
                            key.fileobj.send(AUTH[state[1]:state[1] + 1])
                            state[1] += 1
                        except OSError:
                            pass
                        state[2] = now
        finally:
            for key in list(sel.get_map().values()):
                key.fileobj.close()
            sel.close()
