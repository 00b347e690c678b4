"""Optional TLS for the control channel (``messenger.tls: {cert, key, ca}``).

The cluster secret's handshake (pdkv/auth.py) already makes every control frame authentic;
TLS adds what it cannot: confidentiality (prompts travel on this channel as token ids) and a
second, independent proof of membership — each side presents a certificate and verifies the
peer's against the cluster's CA (mutual TLS), and only then does the HMAC handshake run inside.

Identity is the CA, not a host name: nodes dial each other by address and every node of a
cluster holds a certificate from the same CA, so the client does not check host names. Use a CA
dedicated to the cluster (a certificate from it is a ticket into the cluster). TLS 1.3 only: both
ends are pdkv. An encrypted key is refused (no prompt for a pass phrase in a service).

The prefill node upgrades an accepted connection only after it was counted against the
listener's caps (``start_tls`` on the stream), so a flood of connections that never finish TLS
is bounded the same way and cut at the handshake deadline. Such a stream must read nothing
before its upgrade (``start_server`` below): a ClientHello that landed in the plain stream's
buffer would be lost to the TLS layer and the handshake would hang until the deadline (seen
under load before the streams started paused).
"""

from __future__ import annotations

import asyncio
import ssl

from pdkv.config import ConfigError
from pdkv.config.sections import TLSConfig


def enabled(t: TLSConfig) -> bool:
    return bool(t.cert or t.key or t.ca)


def _context(t: TLSConfig, server_side: bool) -> ssl.SSLContext:
    for name in ("cert", "key", "ca"):
        if not getattr(t, name):
            raise ConfigError(f"messenger.tls.{name} must be set when messenger.tls is (cert, key and ca together)")
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER if server_side else ssl.PROTOCOL_TLS_CLIENT)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_3
    ctx.check_hostname = False  # NOTE: identity is the cluster CA (see the module docstring)
    ctx.verify_mode = ssl.CERT_REQUIRED  # the server asks for the client's certificate too
    for name in ("cert", "key", "ca"):
        try:
            with open(getattr(t, name), "rb") as f:
                f.read(1)
        except OSError as e:
            raise ConfigError(f"messenger.tls.{name}: cannot read {getattr(t, name)!r}: {e.strerror}") from e
    try:
        ctx.load_cert_chain(t.cert, t.key, password=lambda: b"")
    except ssl.SSLError as e:
        raise ConfigError(f"messenger.tls.cert / messenger.tls.key: cannot load {t.cert!r} with the key {t.key!r} "
                          f"({e.reason or e}): a PEM certificate and its unencrypted private key") from e
    try:
        ctx.load_verify_locations(cafile=t.ca)
    except ssl.SSLError as e:
        raise ConfigError(f"messenger.tls.ca: cannot load {t.ca!r} ({e.reason or e}): a PEM CA certificate") from e
    return ctx


def server_context(t: TLSConfig) -> ssl.SSLContext | None:
    """The prefill node's listener context, or None without messenger.tls. ConfigError names the field."""
    return _context(t, True) if enabled(t) else None


def client_context(t: TLSConfig) -> ssl.SSLContext | None:
    """The decode node's dialling context, or None without messenger.tls."""
    return _context(t, False) if enabled(t) else None


def describe(e: BaseException) -> str:
    """What a failed TLS handshake means, in the operator's terms."""
    text = str(getattr(e, "reason", None) or e)
    low = text.lower()
    if ("certificate_required" in low or "certificate required" in low or "did_not_return_a_certificate" in low
            or "did not return a certificate" in low):
        return f"the peer presented no certificate ({text}): set messenger.tls on both nodes"
    if "unknown_ca" in low or "unknown ca" in low or "certificate verify failed" in low or "verify" in low:
        return f"the certificate is not signed by the cluster's CA (messenger.tls.ca) ({text})"
    if "wrong_version" in low or "wrong version" in low or "http_request" in low or "record" in low:
        return f"the peer does not speak TLS ({text}): set messenger.tls on both nodes or on neither"
    return text


class _PausedStreamProtocol(asyncio.StreamReaderProtocol):
    """A server stream that reads nothing until it is upgraded: bytes a dialler sends at once
    (its ClientHello) must reach the TLS layer, not the plain stream's buffer."""

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        transport.pause_reading()  # NOTE: before the transport's first read (it is scheduled after this)


async def start_server(client_connected_cb, host: str, port: int, upgrade_later: bool) -> asyncio.AbstractServer:
    """asyncio.start_server, except that with ``upgrade_later`` every accepted stream starts paused
    so the callback can count it against the listener's caps and only then ``start_tls`` it."""
    loop = asyncio.get_running_loop()
    if not upgrade_later:
        return await asyncio.start_server(client_connected_cb, host, port)

    def factory():
        return _PausedStreamProtocol(asyncio.StreamReader(loop=loop), client_connected_cb, loop=loop)

    return await loop.create_server(factory, host, port)
