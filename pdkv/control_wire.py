"""What travels on the control channel: its frames, the HELLO each side sends, and its errors.

Frame: a 4-byte big-endian length, then a msgpack map with a "type" key. A frame larger than its
limit or one that does not decode to a map is a protocol error: the connection is dropped with an
error that says what was wrong (nothing is half-applied). With a cluster secret a frame's body
ends in a MAC (pdkv/auth.py ``Sealer``) over a sequence number and the body.

The handshake that uses these is pdkv/control_handshake.py, the channel pdkv/control.py (which
re-exports every name here).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import struct
from dataclasses import asdict, dataclass, field

import msgpack

from pdkv import auth

PROTOCOL_VERSION = 2  # 2: authentication before HELLO
MAX_FRAME = 64 << 20  # default after the handshake (messenger.max_frame_bytes)
PRE_AUTH_MAX_FRAME = 64 << 10  # AUTH, PROOF, HELLO, REFUSE are small: nothing big before trust
_LEN = struct.Struct(">I")

# Fields of Hello that both sides must agree on, in the order differences are reported.
MUST_MATCH = ("protocol", "model_fingerprint", "dtype", "kv_dtype", "kv_layout", "page_size", "parallel")


class ControlError(ConnectionError):
    """The control connection broke or the peer spoke something that is not the protocol."""


class HandshakeRefused(ControlError):
    """The two sides cannot work together; the message names every difference."""


class AuthenticationFailed(HandshakeRefused):
    """The peer did not prove it holds the cluster secret (or the two disagree on having one)."""


class TLSRefused(HandshakeRefused):
    """The TLS handshake failed (messenger.tls): no certificate, one not from the cluster's CA,
    or a peer that speaks plain text. Final: a redial with the same files fails the same way."""


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
class Auth:
    """The first frame each side sends: a fresh nonce, and whether it has a cluster secret."""

    nonce: bytes
    secret: bool

    TYPE = "AUTH"

    def to_wire(self) -> dict:
        return {"type": self.TYPE, "nonce": self.nonce, "secret": self.secret}

    @classmethod
    def parse(cls, msg: dict) -> "Auth":
        nonce = msg.get("nonce")
        if not isinstance(nonce, bytes) or len(nonce) != auth.NONCE_BYTES:
            raise ControlError("peer AUTH carries no valid nonce")
        return cls(nonce, bool(msg.get("secret")))  # NOTE: any true value: an older peer's form


@dataclass(frozen=True)
class Proof:
    """With a cluster secret: the HMAC proving this side holds it for this exchange's nonces
    (checked by pdkv.auth.check_proof, which refuses anything that is not bytes)."""

    mac: object

    TYPE = "PROOF"

    def to_wire(self) -> dict:
        return {"type": self.TYPE, "mac": self.mac}

    @classmethod
    def parse(cls, msg: dict) -> "Proof":
        return cls(msg.get("mac"))


@dataclass(frozen=True)
class Refuse:
    """The pair cannot work together (``reason`` names why); ``busy``: the refusing node is
    full now, worth a redial (a prefill node's answer to CONNECT)."""

    reason: str
    busy: bool = False

    TYPE = "REFUSE"

    def to_wire(self) -> dict:
        out = {"type": self.TYPE, "reason": self.reason}
        if self.busy:
            out["busy"] = True
        return out

    @classmethod
    def parse(cls, msg: dict) -> "Refuse":
        # NOTE: a refusal is shown to the operator as sent: a reason that is no string is shown
        # as what it was, never a second error hiding the first
        reason = msg.get("reason")
        return cls(reason if isinstance(reason, str) else repr(reason)[:200], msg.get("busy") is True)


@dataclass(frozen=True)
class Heartbeat:
    """Sent by each side every heartbeat interval: its clock (``t``, time.time) and whatever the
    role adds (``fields``: a prefill node's load, checked by the role that reads it)."""

    t: float
    fields: dict = field(default_factory=dict)

    TYPE = "HEARTBEAT"

    def to_wire(self) -> dict:
        return {**self.fields, "type": self.TYPE, "t": self.t}

    @classmethod
    def parse(cls, msg: dict) -> "Heartbeat":
        """ValueError naming ``t`` if it is no time; the other fields are the role's."""
        t = msg.get("t")
        if not isinstance(t, (int, float)) or isinstance(t, bool) or t != t:
            raise ValueError(f"HEARTBEAT t must be a time in seconds, got {t!r}"[:200])
        return cls(float(t), {k: v for k, v in msg.items() if k not in ("type", "t")})


@dataclass(frozen=True)
class Hello:
    node_id: int
    role: str  # "prefill" | "decode"
    model_fingerprint: str
    dtype: str
    kv_layout: str
    page_size: int
    parallel: dict = field(default_factory=lambda: {"tp": 1})
    # The KV cache's element type ("bfloat16", "float8_e4m3fn", ...): pages move as bytes, so
    # both sides must store the same one. "": a peer that does not say (the model's dtype).
    kv_dtype: str = ""
    protocol: int = PROTOCOL_VERSION
    # What the data path needs; not compared: transport name and its connection blob,
    # registered regions (key, length, page geometry), and anything else the role adds.
    transport: dict = field(default_factory=dict)
    extra: dict = field(default_factory=dict)
    # What the prefill node prepares for the decode node's speculative proposer (method, draft
    # model, MTP layers: pdkv/disagg/protocol.py spec_handoff); must match key by key. {}: nothing.
    speculative: dict = field(default_factory=dict)
    # This host's identity (pdkv.disagg.protocol.host_identity; not compared): equal on both
    # sides means one host, where messenger.transport auto offers shm. "": a peer that does not say.
    host: str = ""

    def differences(self, other: "Hello") -> list[str]:
        out = []
        for name in MUST_MATCH:
            mine, theirs = getattr(self, name), getattr(other, name)
            if mine != theirs:
                out.append(f"{name}: this {self.role} node has {mine!r}, the {other.role} node has {theirs!r}")
        out += self._spec_differences(other)
        if self.transport.get("name") != other.transport.get("name"):
            out.append(f"transport: {self.transport.get('name')!r} vs {other.transport.get('name')!r}")
        elif bool(self.transport.get("tls_data")) != bool(other.transport.get("tls_data")):
            out.append(f"transport.tls_data: this {self.role} node has {bool(self.transport.get('tls_data'))}, "
                       f"the {other.role} node has {bool(other.transport.get('tls_data'))} "
                       "(messenger.tls_data must be the same on both)")
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

    def to_wire(self) -> dict:
        return {"type": "HELLO", **asdict(self)}

    @classmethod
    def parse(cls, msg: dict) -> "Hello":
        """A peer's HELLO frame; ControlError names what is missing or wrong (the fields that must
        match are compared by ``differences``, the role's extras by the role)."""
        try:
            peer = cls.from_dict({k: v for k, v in msg.items() if k != "type"})
        except TypeError as e:
            raise ControlError(f"malformed peer HELLO: {e}") from e
        if not isinstance(peer.node_id, int) or isinstance(peer.node_id, bool) or not 0 < peer.node_id < 2**63:
            raise ControlError(f"peer HELLO has an invalid node_id {peer.node_id!r} (an integer in 1..2**63-1)")
        return peer


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
    # NOTE: every error below is raised after the frame's bytes and whatever they decoded to are
    # dropped: a traceback keeps this frame's locals alive, and one caught in a task can sit in a
    # reference cycle until the collector runs (a refused 16 MiB frame then held ~150 MB)
    msg, error = _decode(body, sealer, limit)
    del body
    if error is not None:
        raise error
    return msg


def _decode(body: bytes, sealer: auth.Sealer | None, limit: int) -> tuple[dict | None, ControlError | None]:
    """(the frame's map, None) or (None, the error). What a frame decodes to is bounded: at most
    ``limit // 8`` elements in all, a container counting 8 more (its own object), each one's
    length checked before it is built (a frame of nils or of empty lists would otherwise grow
    8-60x on decoding; now about 1x, and ints at most 5x)."""
    view = memoryview(body)
    if sealer is not None:
        tag_len = auth.TAG_BYTES
        if len(body) < tag_len or not sealer.check(view[:-tag_len], view[-tag_len:]):
            return None, ControlError("control frame failed its authentication check (altered, replayed or "
                                      "injected): dropping the connection")
        view = view[:-tag_len]
    cap = max(limit // 8, 64)
    left = [cap]

    def spend(container):
        left[0] -= len(container) + 8
        if left[0] < 0:
            raise ValueError(f"more than {cap} elements in all")
        return container
    try:
        msg = msgpack.unpackb(view, raw=False, strict_map_key=False, list_hook=spend, object_hook=spend,
                              max_array_len=cap, max_map_len=cap, max_str_len=limit, max_bin_len=limit,
                              max_ext_len=0)
    except Exception as e:  # msgpack raises several unrelated types for garbage
        return None, ControlError(f"undecodable control frame: {e}")
    finally:
        view.release()
    if not isinstance(msg, dict) or not isinstance(msg.get("type"), str):
        return None, ControlError("control frame is not a map with a 'type' field")
    return msg, None
