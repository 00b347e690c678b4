"""Node authentication: the cluster secret, the mutual HMAC challenge-response, sealed frames.

Every node of a cluster holds the same secret (``PDKV_CLUSTER_SECRET`` in the environment, or
the file ``messenger.secret_file`` names — never the command line, where ``ps`` shows it).
The control handshake (pdkv.control) runs this exchange before anything else is accepted::

    both   -> AUTH{nonce: 32 fresh random bytes, secret: bool}
    dialer -> PROOF{mac: HMAC(k, "dial"   | acceptor nonce | dialer nonce)}
    acceptor verifies, then -> PROOF{mac: HMAC(k, "accept" | dialer nonce | acceptor nonce)}

Fresh nonces both ways make a recorded handshake useless (its MAC covers the old nonce of the
side being replayed to); the role labels make echoing the peer's own proof back fail; the
acceptor proves itself only after the dialer did, so it is no oracle for strangers. Then both
derive a session key from both nonces: every later frame carries a MAC over a per-direction
sequence number and its body (``Sealer``), so a relay that sat in the middle of the handshake
can neither inject nor alter a message, and the data transport's token (pdkv._messenger
prepare(peer, token)) is derived from the same session so a data stream binds to it.
Without a secret (loopback-only or ``messenger.insecure: true``) nonces are still exchanged and
the token still binds the data streams to this control session, but nothing is proven.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import logging
import os
import secrets
import socket
import stat
import struct
from pathlib import Path

log = logging.getLogger(__name__)
SECRET_ENV = "PDKV_CLUSTER_SECRET"
NONCE_BYTES, TAG_BYTES, MIN_SECRET_BYTES = 32, 16, 16
_SEQ = struct.Struct(">Q")


class AuthError(ValueError):
    """The cluster secret is missing, unreadable or too weak, or a node would listen exposed."""


def load_secret(secret_file: str = "", env: dict | None = None) -> bytes | None:
    """The cluster secret: the environment wins over the file; None when neither is set.
    A file readable by group or others is refused (it is a credential)."""
    env = os.environ if env is None else env
    raw = env.get(SECRET_ENV, "")
    where = f"${SECRET_ENV}"
    if not raw and secret_file:
        p = Path(secret_file)
        try:
            mode = p.stat().st_mode
            raw = p.read_text().strip()
        except OSError as e:
            raise AuthError(f"messenger.secret_file {secret_file}: cannot read it: {e}") from e
        if mode & (stat.S_IRWXG | stat.S_IRWXO):
            raise AuthError(f"messenger.secret_file {secret_file}: readable by others (mode "
                            f"{stat.S_IMODE(mode):o}); chmod 600 it")
        where = secret_file
    if not raw:
        return None
    secret = raw.encode()
    if len(secret) < MIN_SECRET_BYTES:
        raise AuthError(f"cluster secret from {where} is {len(secret)} bytes; at least {MIN_SECRET_BYTES} needed")
    return secret


def new_secret() -> str:
    return secrets.token_hex(32)


def write_secret_file(path: Path) -> str:
    """A fresh secret in ``path``, created 0600 (never briefly world-readable)."""
    s = new_secret()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(s + "\n")
    return s


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    if not host:  # every interface
        return False
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        try:
            return all(ipaddress.ip_address(a[4][0]).is_loopback for a in socket.getaddrinfo(host, None))
        except OSError:
            return False


def check_exposure(listeners: dict[str, str], secret: bytes | None, insecure: bool) -> None:
    """Without a secret a node listens on loopback only, unless the config says insecure."""
    exposed = {name: host for name, host in listeners.items() if not is_loopback(host)}
    if not exposed or secret is not None:
        return
    what = ", ".join(f"{n}={h!r}" for n, h in exposed.items())
    if not insecure:
        raise AuthError(f"no cluster secret (${SECRET_ENV} or messenger.secret_file) but this node would listen "
                        f"beyond loopback ({what}): anyone who can reach it could drive it. Set a secret, bind "
                        f"to 127.0.0.1, or set messenger.insecure: true to accept the risk")
    log.warning("!!! INSECURE: no cluster secret and listening on %s: any host that reaches these ports can act "
                "as a cluster node (messenger.insecure: true) !!!", what)


def new_nonce() -> bytes:
    return secrets.token_bytes(NONCE_BYTES)


def proof(secret: bytes, label: bytes, their_nonce: bytes, my_nonce: bytes) -> bytes:
    return hmac.new(secret, b"pdkv-auth/1|" + label + b"|" + their_nonce + my_nonce, hashlib.sha256).digest()


def check_proof(secret: bytes, label: bytes, mac: object, my_nonce: bytes, their_nonce: bytes) -> bool:
    """The peer (whose role is ``label``) proved it holds the secret for THIS exchange."""
    return isinstance(mac, bytes) and hmac.compare_digest(mac, proof(secret, label, my_nonce, their_nonce))


def session_material(secret: bytes | None, dial_nonce: bytes, accept_nonce: bytes) -> tuple[bytes, bytes]:
    """(session key, data-transport token), the same at both ends."""
    base = secret if secret is not None else b"pdkv-insecure"
    key = hmac.new(base, b"pdkv-session/1|" + dial_nonce + accept_nonce, hashlib.sha256).digest()
    token = hmac.new(key, b"pdkv-data-token/1", hashlib.sha256).digest()
    return key, token


def data_key(session_key: bytes) -> bytes:
    """The tcp data streams' key of a session (messenger.tls_data), the same at both ends; only
    with a cluster secret (without one the session key derives from public nonces)."""
    return hmac.new(session_key, b"pdkv-data-key/1", hashlib.sha256).digest()


class Sealer:
    """MACs one direction of an authenticated channel: tag = HMAC(key, dir | seq | body)[:16].
    A dropped, replayed, reordered or altered frame fails the check (the channel breaks)."""

    def __init__(self, key: bytes, direction: bytes):
        self.key, self.direction, self.seq = key, direction, 0

    def tag(self, body: bytes) -> bytes:
        h = hmac.new(self.key, self.direction + _SEQ.pack(self.seq), hashlib.sha256)
        h.update(body)  # NOTE: no copy of a large frame's body (it may be a memoryview of it)
        t = h.digest()[:TAG_BYTES]
        self.seq += 1
        return t

    def check(self, body: bytes, tag: bytes) -> bool:
        return hmac.compare_digest(self.tag(body), tag)
