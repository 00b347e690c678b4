"""The control channel between messengers: msgpack frames over one persistent TCP connection.

Page data never travels here (it moves through the transport as one-sided writes); this channel
carries the handshake, PREFILL / CANCEL / CANCEL_ACK / FAIL requests and heartbeats.

Three files: the frames, HELLO and the errors are pdkv/control_wire.py; opening a connection
(TLS, authentication, HELLO both ways, REFUSE naming every difference) is
pdkv/control_handshake.py; this file is the established channel: traffic (frames of up to
``max_frame`` bytes, sealed with a cluster secret), heartbeats and the lease. Every public name of
the other two is importable from here.

Liveness: each side sends HEARTBEAT every ``interval`` seconds (plus whatever the role's
``payload()`` adds, e.g. a prefill node's load; the receiver hands it to ``on_heartbeat``); a peer
silent for ``lease`` seconds is declared dead (``on_dead`` fires once), which is what lets a
decode node reuse pages that a dead prefill node might otherwise still write, and lets a prefill
node free source pages of a decode node that disappeared.
"""

from __future__ import annotations

import asyncio
import logging
import ssl as _ssl
import time
from typing import Any, Awaitable, Callable

from pdkv.control_handshake import Session, handshake
from pdkv.control_wire import (MAX_FRAME, MUST_MATCH, PRE_AUTH_MAX_FRAME, PROTOCOL_VERSION,  # noqa: F401 - re-exported
                               Auth, AuthenticationFailed, ControlError, HandshakeRefused, Heartbeat, Hello, Proof, Refuse, TLSRefused,
                               encode_frame, model_fingerprint, read_frame)
from pdkv.tls import describe as _tls_reason

__all__ = ["MAX_FRAME", "MUST_MATCH", "PRE_AUTH_MAX_FRAME", "PROTOCOL_VERSION", "Auth", "AuthenticationFailed",
           "ControlChannel", "ControlError", "HandshakeRefused", "Heartbeat", "Hello", "Proof", "Refuse", "TLSRefused", "encode_frame",
           "model_fingerprint", "read_frame"]

log = logging.getLogger(__name__)


class ControlChannel:
    """One side of an established, authenticated and handshaken control connection.
    ``token``: the data-transport token of this session (pdkv._messenger prepare(peer, token));
    ``authenticated``: the peer proved it holds the cluster secret."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                 local: Hello, peer: Hello, token: bytes = b"", seal: tuple | None = None,
                 max_frame: int = MAX_FRAME, data_key: bytes | None = None):
        self.reader, self.writer = reader, writer
        self.local, self.peer = local, peer
        self.token = token
        self.data_key = data_key  # the tcp data streams' key (messenger.tls_data); None without a secret
        self.authenticated = seal is not None
        self._out, self._in = seal if seal is not None else (None, None)
        self.max_frame = max_frame
        self.last_heard = time.monotonic()
        self.last_tick = time.monotonic()  # this side's heartbeat last ran (a stall of this node shows here)
        self._stall: tuple[float, float] | None = None  # (when noticed, how long) of this node's own stall
        self._lease = 0.0
        self._hb_task: asyncio.Task | None = None
        self._closed = False
        # Called with every HEARTBEAT received (its ``fields``, what the role added, are the
        # role's to check); None: heartbeats only refresh liveness.
        self.on_heartbeat: Callable[[Heartbeat], None] | None = None

    # -- establishing --------------------------------------------------------------------
    @classmethod
    async def connect(cls, host: str, port: int, hello: Hello, timeout: float = 10.0, *,
                      secret: bytes | None = None, max_frame: int = MAX_FRAME, ssl=None) -> "ControlChannel":
        """``ssl``: a client context (pdkv.tls.client_context): TLS first, then the handshake inside."""
        tls = {"ssl": ssl, "ssl_handshake_timeout": timeout} if ssl is not None else {}
        try:
            reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port, **tls), timeout)
        except _ssl.SSLError as e:
            raise TLSRefused(f"TLS handshake with {host}:{port} failed: {_tls_reason(e)}") from e
        except (OSError, asyncio.TimeoutError) as e:
            raise ControlError(f"cannot reach the peer at {host}:{port}: {e}") from e
        session = await handshake(reader, writer, hello, timeout, secret, True, dial_tls=ssl is not None)
        return cls._open(reader, writer, hello, session, max_frame)

    @classmethod
    async def accept(cls, reader, writer, hello: Hello, timeout: float = 10.0, *,
                     secret: bytes | None = None, max_frame: int = MAX_FRAME, ssl=None) -> "ControlChannel":
        """``ssl``: a server context (pdkv.tls.server_context): the accepted stream is upgraded to
        TLS first, within the same deadline as the rest of the handshake."""
        session = await handshake(reader, writer, hello, timeout, secret, False, ssl)
        return cls._open(reader, writer, hello, session, max_frame)

    @classmethod
    def _open(cls, reader, writer, hello: Hello, session: Session, max_frame: int) -> "ControlChannel":
        return cls(reader, writer, hello, session.peer, session.token, session.seal, max_frame, session.data_key)

    # -- traffic -------------------------------------------------------------------------
    async def send(self, msg: dict) -> None:
        if self._closed:
            raise ControlError("control channel is closed")
        try:
            self.writer.write(encode_frame(msg, self._out, self.max_frame))
            await self.writer.drain()
        except (ConnectionError, OSError) as e:
            raise ControlError(f"control channel to node {self.peer.node_id:#x} broke: {e}") from e

    async def recv(self) -> dict:
        """Next non-heartbeat message. Heartbeats only refresh ``last_heard``."""
        while True:
            msg = await read_frame(self.reader, self._in, self.max_frame)
            self.last_heard = time.monotonic()
            if msg["type"] != Heartbeat.TYPE:
                return msg
            if self.on_heartbeat is not None:
                try:
                    self.on_heartbeat(Heartbeat.parse(msg))
                except ValueError as e:  # a malformed one still proves the peer alive
                    log.warning("control: a malformed heartbeat from node %#x: %s", self.peer.node_id, e)
                except Exception:  # noqa: BLE001 - what a heartbeat carries never breaks the channel
                    log.exception("control: heartbeat handler failed on a heartbeat from node %#x", self.peer.node_id)

    def start_heartbeat(self, interval: float, lease: float,
                        on_dead: Callable[[str], Awaitable[None] | None],
                        payload: Callable[[], dict] | None = None) -> None:
        """Send heartbeats every ``interval`` s; call ``on_dead(reason)`` once if the peer is silent
        for ``lease`` s. Receiving is the caller's loop (``recv``), which refreshes liveness.
        ``payload()``: more fields for each heartbeat (read at each beat)."""
        self._lease = lease

        async def beat():
            while not self._closed:
                now = time.monotonic()
                if now - self.last_tick > lease:
                    # NOTE: THIS node did not run for longer than the lease (SIGSTOP, a VM pause, a
                    # blocked loop): the peer's silence is ours; give it a fresh lease to speak.
                    self._stall = (now, now - self.last_tick)
                    self.last_heard = now
                self.last_tick = now
                extra = {}
                if payload is not None:
                    try:
                        extra = payload()
                    except Exception:  # noqa: BLE001 - a broken payload must not stop the liveness beat
                        log.exception("control: heartbeat payload failed; sending a plain heartbeat")
                try:
                    await self.send(Heartbeat(time.time(), extra).to_wire())
                except ControlError as e:
                    await _maybe_await(on_dead(str(e)))
                    return
                silent = time.monotonic() - self.last_heard
                if silent > lease:
                    await _maybe_await(on_dead(f"peer silent for {silent:.1f} s (lease {lease} s)"))
                    self.close()
                    return
                await asyncio.sleep(interval)
        self._hb_task = asyncio.get_running_loop().create_task(beat())

    def own_stall(self) -> float | None:
        """Seconds this node itself stood still (its heartbeat did not run) if that is longer than
        the lease and recent, else None: then a peer that gave up on us did not die."""
        if self._hb_task is None:
            return None
        now = time.monotonic()
        if now - self.last_tick > self._lease:
            return now - self.last_tick
        if self._stall is not None and now - self._stall[0] < 2 * self._lease + 1:
            return self._stall[1]
        return None

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._hb_task is not None and self._hb_task is not asyncio.current_task():
            self._hb_task.cancel()
        self.writer.close()

    @property
    def closed(self) -> bool:
        return self._closed


async def _maybe_await(x: Any) -> None:
    if asyncio.iscoroutine(x):
        await x
