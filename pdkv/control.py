"""The control channel between messengers: msgpack frames over one persistent TCP connection.

Page data never travels here (it moves through the transport as one-sided writes); this channel
carries the handshake, PREFILL / CANCEL / CANCEL_ACK / FAIL requests and heartbeats.

Frame: a 4-byte big-endian length, then a msgpack map with a "type" key. A frame larger than
``MAX_FRAME`` or one that does not decode to a map is a protocol error: the connection is
dropped with an error that says what was wrong (nothing is half-applied).

Authentication comes first (pdkv/auth.py): AUTH nonces both ways, then the dialer's PROOF, then
the acceptor's; until then a frame may be at most ``PRE_AUTH_MAX_FRAME`` bytes and the whole
handshake must finish within its timeout. With a cluster secret every later frame is sealed
(a MAC over a sequence number and the body); after the handshake frames may be ``max_frame``.

Handshake: each side then sends HELLO and reads the peer's. When the two disagree on anything
that must match (model fingerprint, dtype, KV layout, page size, parallel plan, protocol
version, the speculative hand-off field by field) each side sends REFUSE naming every
difference, and both raise ``HandshakeRefused``.

Liveness: each side sends HEARTBEAT every ``interval`` seconds (plus whatever the role's
``payload()`` adds, e.g. a prefill node's load; the receiver hands it to ``on_heartbeat``); a peer
silent for ``lease`` seconds is declared dead (``on_dead`` fires once), which is what lets a
decode node reuse pages that a dead prefill node might otherwise still write, and lets a prefill
node free source pages of a decode node that disappeared.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import ssl as _ssl
import struct
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Awaitable, Callable

import msgpack

from pdkv import auth
from pdkv.tls import describe as _tls_reason

log = logging.getLogger(__name__)

PROTOCOL_VERSION = 2  # 2: authentication before HELLO
MAX_FRAME = 64 << 20  # default after the handshake (messenger.max_frame_bytes)
PRE_AUTH_MAX_FRAME = 64 << 10  # AUTH, PROOF, HELLO, REFUSE are small: nothing big before trust
_LEN = struct.Struct(">I")

# Fields of Hello that both sides must agree on, in the order differences are reported.
MUST_MATCH = ("protocol", "model_fingerprint", "dtype", "kv_layout", "page_size", "parallel")


class ControlError(ConnectionError):
    """The control connection broke or the peer spoke something that is not the protocol."""


class HandshakeRefused(ControlError):
    """The two sides cannot work together; the message names every difference."""


class AuthenticationFailed(HandshakeRefused):
    """The peer did not prove it holds the cluster secret (or the two disagree on having one)."""


class TLSRefused(HandshakeRefused):
    """The TLS handshake failed (messenger.tls): no certificate, one not from the cluster's CA,
    or a peer that speaks plain text. Final: a redial with the same files fails the same way."""


# NOTE: under TLS 1.3 the acceptor checks the dialler's certificate after the dialler's side of the
# TLS handshake completed: its refusal reaches the dialler as a close before the first frame
_TLS_CLOSED = ("TLS: the peer closed the connection right after the TLS handshake ({}): it did not accept this "
               "node's certificate (messenger.tls: none, or not from its CA)")


def _tls_record(head: bytes) -> bool:
    """A TLS record header (handshake, alert, ...: type 20..23, major version 3) where a frame
    length was expected: the peer speaks TLS and this side does not."""
    return 20 <= head[0] <= 23 and head[1] == 3


def model_fingerprint(config: dict, param_shapes: dict[str, tuple[int, ...]]) -> str:
    """A short digest of what makes two model replicas interchangeable for KV transfer:
    the architecture config (minus fields that do not affect the math) and every weight's shape."""
    ignored = {"_name_or_path", "transformers_version", "torch_dtype", "dtype", "use_cache"}
    cfg = {k: v for k, v in sorted(config.items()) if k not in ignored}
    h = hashlib.sha256(json.dumps(cfg, sort_keys=True, default=str).encode())
    for name in sorted(param_shapes):
        h.update(f"{name}:{tuple(param_shapes[name])};".encode())
    return h.hexdigest()[:16]


@dataclass(frozen=True)
class Hello:
    node_id: int
    role: str  # "prefill" | "decode"
    model_fingerprint: str
    dtype: str
    kv_layout: str
    page_size: int
    parallel: dict = field(default_factory=lambda: {"tp": 1})
    protocol: int = PROTOCOL_VERSION
    # What the data path needs; not compared: transport name and its connection blob,
    # registered regions (key, length, page geometry), and anything else the role adds.
    transport: dict = field(default_factory=dict)
    extra: dict = field(default_factory=dict)
    # What the prefill node prepares for the decode node's speculative proposer (method, draft
    # model, MTP layers: pdkv/disagg/protocol.py spec_handoff); must match key by key. {}: nothing.
    speculative: dict = field(default_factory=dict)

    def differences(self, other: "Hello") -> list[str]:
        out = []
        for name in MUST_MATCH:
            mine, theirs = getattr(self, name), getattr(other, name)
            if mine != theirs:
                out.append(f"{name}: this {self.role} node has {mine!r}, the {other.role} node has {theirs!r}")
        out += self._spec_differences(other)
        if self.transport.get("name") != other.transport.get("name"):
            out.append(f"transport: {self.transport.get('name')!r} vs {other.transport.get('name')!r}")
        return out

    def _spec_differences(self, other: "Hello") -> list[str]:
        """Each speculative field that differs, named (``speculative.method: ...``)."""
        mine, theirs = self.speculative, other.speculative
        if not isinstance(theirs, dict):
            return [f"speculative: the {other.role} node sent {theirs!r}"[:200] + " (not a map)"]
        keys = list(mine) + [k for k in theirs if k not in mine]
        return [f"speculative.{k}: this {self.role} node has {mine.get(k)!r}, the {other.role} node has "
                f"{theirs.get(k)!r}" for k in keys if mine.get(k) != theirs.get(k)]

    @classmethod
    def from_dict(cls, d: dict) -> "Hello":
        known = {f for f in cls.__dataclass_fields__}
        missing = [f for f in ("node_id", "role", "model_fingerprint", "dtype", "kv_layout", "page_size")
                   if f not in d]
        if missing:
            raise ControlError(f"peer HELLO lacks {', '.join(missing)}")
        return cls(**{k: v for k, v in d.items() if k in known})


def encode_frame(msg: dict, sealer: auth.Sealer | None = None, limit: int = MAX_FRAME) -> bytes:
    body = msgpack.packb(msg, use_bin_type=True)
    if len(body) > limit:
        raise ControlError(f"control frame of {len(body)} bytes exceeds the {limit}-byte limit")
    if sealer is not None:
        body += sealer.tag(body)
    return _LEN.pack(len(body)) + body


async def read_frame(reader: asyncio.StreamReader, sealer: auth.Sealer | None = None,
                     limit: int = MAX_FRAME) -> dict:
    try:
        head = await reader.readexactly(_LEN.size)
    except asyncio.IncompleteReadError as e:
        raise ControlError("control connection closed by peer") from e
    except OSError as e:  # e.g. a reset: the same ending, said the same way
        raise ControlError(f"control connection broke: {e}") from e
    (n,) = _LEN.unpack(head)
    tag_len = auth.TAG_BYTES if sealer is not None else 0
    if n > limit + tag_len:  # refused before a byte of it is read: nothing big is buffered
        if _tls_record(head):
            raise TLSRefused("the peer speaks TLS and this node does not: set messenger.tls on both nodes or "
                             "on neither")
        raise ControlError(f"peer sent a control frame of {n} bytes (limit {limit})")
    try:
        body = await reader.readexactly(n)
    except asyncio.IncompleteReadError as e:
        raise ControlError("control connection closed in the middle of a frame") from e
    except OSError as e:
        raise ControlError(f"control connection broke in the middle of a frame: {e}") from e
    if sealer is not None:
        if n < tag_len or not sealer.check(body[:-tag_len], body[-tag_len:]):
            raise ControlError("control frame failed its authentication check (altered, replayed or "
                               "injected): dropping the connection")
        body = body[:-tag_len]
    try:
        msg = msgpack.unpackb(body, raw=False, strict_map_key=False)
    except Exception as e:  # msgpack raises several unrelated types for garbage
        raise ControlError(f"undecodable control frame: {e}") from e
    if not isinstance(msg, dict) or not isinstance(msg.get("type"), str):
        raise ControlError("control frame is not a map with a 'type' field")
    return msg


class ControlChannel:
    """One side of an established, authenticated and handshaken control connection.
    ``token``: the data-transport token of this session (pdkv._messenger prepare(peer, token));
    ``authenticated``: the peer proved it holds the cluster secret."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                 local: Hello, peer: Hello, token: bytes = b"", seal: tuple | None = None,
                 max_frame: int = MAX_FRAME):
        self.reader, self.writer = reader, writer
        self.local, self.peer = local, peer
        self.token = token
        self.authenticated = seal is not None
        self._out, self._in = seal if seal is not None else (None, None)
        self.max_frame = max_frame
        self.last_heard = time.monotonic()
        self.last_tick = time.monotonic()  # this side's heartbeat last ran (a stall of this node shows here)
        self._stall: tuple[float, float] | None = None  # (when noticed, how long) of this node's own stall
        self._lease = 0.0
        self._hb_task: asyncio.Task | None = None
        self._closed = False
        # Called with every HEARTBEAT received (the whole message, unchecked: what the role added
        # to it is the role's to check); None: heartbeats only refresh liveness.
        self.on_heartbeat: Callable[[dict], None] | None = None

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
        return await cls._handshake(reader, writer, hello, timeout, secret, True, max_frame, dial_tls=ssl is not None)

    @classmethod
    async def accept(cls, reader, writer, hello: Hello, timeout: float = 10.0, *,
                     secret: bytes | None = None, max_frame: int = MAX_FRAME, ssl=None) -> "ControlChannel":
        """``ssl``: a server context (pdkv.tls.server_context): the accepted stream is upgraded to
        TLS first, within the same deadline as the rest of the handshake."""
        return await cls._handshake(reader, writer, hello, timeout, secret, False, max_frame, ssl)

    @classmethod
    async def _handshake(cls, reader, writer, hello: Hello, timeout: float, secret: bytes | None,
                         dialer: bool, max_frame: int, tls=None, dial_tls: bool = False) -> "ControlChannel":
        """The whole exchange (TLS on accept, authentication, HELLO) must finish within ``timeout`` s."""
        async def run():
            if tls is not None:
                try:
                    await writer.start_tls(tls, ssl_handshake_timeout=timeout)
                except _ssl.SSLError as e:
                    raise TLSRefused(f"TLS handshake failed: {_tls_reason(e)}") from e
            return await cls._exchange(reader, writer, hello, secret, dialer, max_frame, heard)

        heard = [0]  # frames read from the peer so far
        try:
            return await asyncio.wait_for(run(), timeout)
        except asyncio.TimeoutError as e:
            writer.close()
            raise ControlError(f"peer did not complete the handshake within {timeout} s") from e
        except ControlError as e:
            writer.close()
            if isinstance(e.__cause__, _ssl.SSLError) and not isinstance(e, TLSRefused):
                # e.g. the acceptor refused this node's certificate: TLS 1.3 says so at the first read
                raise TLSRefused(f"TLS: the peer refused this node: {_tls_reason(e.__cause__)}") from e
            if dial_tls and not heard[0] and not isinstance(e, HandshakeRefused):
                raise TLSRefused(_TLS_CLOSED.format(e)) from e
            raise
        except OSError as e:
            writer.close()
            if isinstance(e, _ssl.SSLError):
                raise TLSRefused(f"TLS: {_tls_reason(e)}") from e
            if dial_tls and not heard[0]:
                raise TLSRefused(_TLS_CLOSED.format(e)) from e
            raise

    @classmethod
    async def _exchange(cls, reader, writer, hello: Hello, secret: bytes | None, dialer: bool,
                        max_frame: int, heard: list | None = None) -> "ControlChannel":
        lim = PRE_AUTH_MAX_FRAME

        async def refuse(reason: str, exc=HandshakeRefused):
            writer.write(encode_frame({"type": "REFUSE", "reason": reason}))
            await writer.drain()
            raise exc(reason)

        async def expect(kind: str, sealer=None) -> dict:
            msg = await read_frame(reader, sealer, lim)
            if heard is not None:
                heard[0] += 1
            if msg["type"] == "REFUSE":
                exc = AuthenticationFailed if "secret" in str(msg.get("reason")) else HandshakeRefused
                raise exc(f"peer refused the handshake: {msg.get('reason')}")
            if msg["type"] != kind:
                raise ControlError(f"expected {kind} from peer, got {msg['type']}"
                                   + (" (an older pdkv without authentication?)" if msg["type"] == "HELLO" else ""))
            return msg

        mine = auth.new_nonce()
        writer.write(encode_frame({"type": "AUTH", "nonce": mine, "secret": secret is not None}))
        await writer.drain()
        msg = await expect("AUTH")
        theirs = msg.get("nonce")
        if not isinstance(theirs, bytes) or len(theirs) != auth.NONCE_BYTES:
            raise ControlError("peer AUTH carries no valid nonce")
        if theirs == mine:
            raise AuthenticationFailed("peer echoed this node's own nonce (a reflection): refused")
        if bool(msg.get("secret")) != (secret is not None):
            await refuse("this node has a cluster secret and the peer has none" if secret is not None else
                         "the peer requires a cluster secret and this node has none", AuthenticationFailed)
        me, them = (b"dial", b"accept") if dialer else (b"accept", b"dial")
        if secret is not None:
            if dialer:
                writer.write(encode_frame({"type": "PROOF", "mac": auth.proof(secret, me, theirs, mine)}))
                await writer.drain()
            got = await expect("PROOF")
            if not auth.check_proof(secret, them, got.get("mac"), mine, theirs):
                await refuse("authentication failed: the peer does not hold this cluster's secret",
                             AuthenticationFailed)
            if not dialer:  # NOTE: only after the dialer proved itself (no oracle for strangers)
                writer.write(encode_frame({"type": "PROOF", "mac": auth.proof(secret, me, theirs, mine)}))
                await writer.drain()
        dial_nonce, accept_nonce = (mine, theirs) if dialer else (theirs, mine)
        key, token = auth.session_material(secret, dial_nonce, accept_nonce)
        out = inn = None
        if secret is not None:
            out, inn = auth.Sealer(key, me), auth.Sealer(key, them)
        writer.write(encode_frame({"type": "HELLO", **asdict(hello)}, out, lim))
        await writer.drain()
        msg = await expect("HELLO", inn)
        try:
            peer = Hello.from_dict({k: v for k, v in msg.items() if k != "type"})
            if not isinstance(peer.node_id, int) or isinstance(peer.node_id, bool) or not 0 < peer.node_id < 2**63:
                raise ControlError(f"peer HELLO has an invalid node_id {peer.node_id!r} (an integer in 1..2**63-1)")
        except TypeError as e:
            raise ControlError(f"malformed peer HELLO: {e}") from e
        diffs = hello.differences(peer)
        if diffs:
            reason = "; ".join(diffs)
            writer.write(encode_frame({"type": "REFUSE", "reason": reason}, out, lim))
            await writer.drain()
            raise HandshakeRefused(f"refusing peer node {peer.node_id:#x}: {reason}")
        return cls(reader, writer, hello, peer, token, (out, inn) if out is not None else None, max_frame)

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
            if msg["type"] != "HEARTBEAT":
                return msg
            if self.on_heartbeat is not None:
                try:
                    self.on_heartbeat(msg)
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
                    await self.send({**extra, "type": "HEARTBEAT", "t": time.time()})
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
