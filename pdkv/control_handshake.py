"""Opening a control connection: TLS (when configured), authentication, then HELLO both ways.

Authentication comes first (pdkv/auth.py): AUTH nonces both ways, then the dialer's PROOF, then
the acceptor's; until then a frame may be at most ``PRE_AUTH_MAX_FRAME`` bytes and the whole
handshake must finish within its timeout. With a cluster secret every later frame is sealed
(a MAC over a sequence number and the body).

Each side then sends HELLO and reads the peer's. When the two disagree on anything that must
match (model fingerprint, dtype, KV layout, page size, parallel plan, protocol version, the
speculative hand-off field by field) each side sends REFUSE naming every difference, and both
raise ``HandshakeRefused``. What a finished handshake yields is a ``Session``; pdkv/control.py
builds the channel around it.
"""

from __future__ import annotations

import asyncio
import ssl as _ssl
from dataclasses import dataclass

from pdkv import auth
from pdkv.control_wire import (PRE_AUTH_MAX_FRAME, Auth, AuthenticationFailed, ControlError, HandshakeRefused, Hello,
                               Proof, Refuse, TLSRefused, encode_frame, read_frame)
from pdkv.tls import describe as _tls_reason

# NOTE: under TLS 1.3 the acceptor checks the dialler's certificate after the dialler's side of the
# TLS handshake completed: its refusal reaches the dialler as a close before the first frame
_TLS_CLOSED = ("TLS: the peer closed the connection right after the TLS handshake ({}): it did not accept this "
               "node's certificate (messenger.tls: none, or not from its CA)")


@dataclass(frozen=True)
class Session:
    """What both sides agreed on. ``token``: the data-transport token of this session
    (pdkv._messenger prepare(peer, token)); ``seal``: (outgoing, incoming) sealers, None without
    a cluster secret."""
    peer: Hello
    token: bytes
    seal: tuple[auth.Sealer, auth.Sealer] | None
    data_key: bytes | None = None  # with a secret: the tcp data streams' key (messenger.tls_data)


async def handshake(reader, writer, hello: Hello, timeout: float, secret: bytes | None,
                    dialer: bool, tls=None, dial_tls: bool = False) -> Session:
    """The whole exchange (TLS on accept, authentication, HELLO) must finish within ``timeout`` s.
    ``tls``: a server context to upgrade the accepted stream with; ``dial_tls``: this side dialled
    over TLS (a close before the first frame then means the peer refused its certificate)."""
    async def run():
        if tls is not None:
            try:
                await writer.start_tls(tls, ssl_handshake_timeout=timeout)
            except _ssl.SSLError as e:
                raise TLSRefused(f"TLS handshake failed: {_tls_reason(e)}") from e
        return await _exchange(reader, writer, hello, secret, dialer, heard)

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


async def _exchange(reader, writer, hello: Hello, secret: bytes | None, dialer: bool,
                    heard: list | None = None) -> Session:
    lim = PRE_AUTH_MAX_FRAME

    async def refuse(reason: str, exc=HandshakeRefused):
        writer.write(encode_frame(Refuse(reason).to_wire()))
        await writer.drain()
        raise exc(reason)

    async def expect(kind: str, sealer=None) -> dict:
        msg = await read_frame(reader, sealer, lim)
        if heard is not None:
            heard[0] += 1
        if msg["type"] == Refuse.TYPE:
            reason = Refuse.parse(msg).reason
            exc = AuthenticationFailed if "secret" in reason else HandshakeRefused
            raise exc(f"peer refused the handshake: {reason}")
        if msg["type"] != kind:
            raise ControlError(f"expected {kind} from peer, got {msg['type']}"
                               + (" (an older pdkv without authentication?)" if msg["type"] == "HELLO" else ""))
        return msg

    mine = auth.new_nonce()
    writer.write(encode_frame(Auth(mine, secret is not None).to_wire()))
    await writer.drain()
    peer_auth = Auth.parse(await expect(Auth.TYPE))
    theirs = peer_auth.nonce
    if theirs == mine:
        raise AuthenticationFailed("peer echoed this node's own nonce (a reflection): refused")
    if peer_auth.secret != (secret is not None):
        await refuse("this node has a cluster secret and the peer has none" if secret is not None else
                     "the peer requires a cluster secret and this node has none", AuthenticationFailed)
    me, them = (b"dial", b"accept") if dialer else (b"accept", b"dial")
    if secret is not None:
        if dialer:
            writer.write(encode_frame(Proof(auth.proof(secret, me, theirs, mine)).to_wire()))
            await writer.drain()
        got = Proof.parse(await expect(Proof.TYPE))
        if not auth.check_proof(secret, them, got.mac, mine, theirs):
            await refuse("authentication failed: the peer does not hold this cluster's secret",
                         AuthenticationFailed)
        if not dialer:  # NOTE: only after the dialer proved itself (no oracle for strangers)
            writer.write(encode_frame(Proof(auth.proof(secret, me, theirs, mine)).to_wire()))
            await writer.drain()
    dial_nonce, accept_nonce = (mine, theirs) if dialer else (theirs, mine)
    key, token = auth.session_material(secret, dial_nonce, accept_nonce)
    out = inn = None
    if secret is not None:
        out, inn = auth.Sealer(key, me), auth.Sealer(key, them)
    writer.write(encode_frame(hello.to_wire(), out, lim))
    await writer.drain()
    peer = Hello.parse(await expect("HELLO", inn))
    diffs = hello.differences(peer)
    if diffs:
        reason = "; ".join(diffs)
        writer.write(encode_frame(Refuse(reason).to_wire(), out, lim))
        await writer.drain()
        raise HandshakeRefused(f"refusing peer node {peer.node_id:#x}: {reason}")
    return Session(peer, token, (out, inn) if out is not None else None,
                   auth.data_key(key) if secret is not None else None)
