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
from dataclasses import dataclass, field

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
