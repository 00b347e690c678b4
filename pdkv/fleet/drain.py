"""Draining a node (SIGTERM, or ``POST /admin/drain``) and the fleet membership around serving.

A draining node takes no new API request (503 + Retry-After + ``X-Pdkv-Draining: 1``, which a
router reads as "try another node"), says ``"draining": true`` in ``/load`` (what a router
polls) and ``state: draining`` in its etcd record (what routers and decode nodes watch), keeps
serving what it has until nothing is in flight, then deregisters and stops; the process exits 0
(1 when ``cluster.drain_timeout_s`` passed with requests still running: they were cut).

``POST /admin/drain`` is authenticated with the cluster secret: the header
``X-Pdkv-Admin: <unix time>:<hex HMAC-SHA256(secret, "pdkv-admin|POST|/admin/drain|<unix time>")>``,
within ADMIN_SKEW_S of the node's clock (``admin_headers`` makes it). The secret itself never
travels. Without a cluster secret only loopback callers may drain a node (as the control
channel listens on loopback only then).
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import ipaddress
import logging
import socket
import time

log = logging.getLogger("pdkv.fleet")
ADMIN_HEADER = "X-Pdkv-Admin"
DRAINING_HEADER = "X-Pdkv-Draining"
ADMIN_SKEW_S = 30.0


def _mac(secret: bytes, method: str, path: str, ts: str) -> str:
    return hmac.new(secret, f"pdkv-admin|{method}|{path}|{ts}".encode(), hashlib.sha256).hexdigest()


def admin_headers(secret: bytes | None, path: str = "/admin/drain", method: str = "POST") -> dict:
    """The header that authenticates an admin call (none without a secret: loopback only)."""
    if secret is None:
        return {}
    ts = str(int(time.time()))
    return {ADMIN_HEADER: f"{ts}:{_mac(secret, method, path, ts)}"}


def admin_refusal(secret: bytes | None, header: str | None, remote: str | None, method: str,
                  path: str) -> str | None:
    """Why an admin call is refused, or None when it is authentic."""
    if secret is None:
        try:
            if remote is not None and ipaddress.ip_address(remote).is_loopback:
                return None
        except ValueError:
            pass
        return "no cluster secret is set on this node: admin calls are accepted from loopback only"
    if not header or ":" not in header:
        return f"missing {ADMIN_HEADER} header (<unix time>:<HMAC of the call with the cluster secret>)"
    ts, _, mac = header.partition(":")
    try:
        skew = abs(time.time() - int(ts))
    except ValueError:
        return f"{ADMIN_HEADER}: the time {ts!r} is not an integer"
    if skew > ADMIN_SKEW_S:
        return f"{ADMIN_HEADER}: the time is {skew:.0f} s off this node's clock (at most {ADMIN_SKEW_S:.0f} s)"
    if not hmac.compare_digest(mac.encode(), _mac(secret, method, path, ts).encode()):
        return f"{ADMIN_HEADER}: the MAC does not match (another cluster secret?)"
    return None


class Drain:
    """The node's draining state, shared by the server's routes and the serve loop."""

    def __init__(self):
        self.requested = asyncio.Event()
        self.draining = False
        self.since: float | None = None
        self.reason = ""

    def request(self, reason: str) -> bool:
        """Start draining (once); False when it already was."""
        if self.draining:
            return False
        self.draining, self.since, self.reason = True, time.monotonic(), reason
        log.warning("draining (%s): no new requests; finishing those in flight", reason)
        self.requested.set()
        return True


def advertised_host(host: str) -> str:
    """An address peers can dial for a listener bound to ``host`` (a wildcard: this host's name)."""
    return socket.gethostname() if host in ("0.0.0.0", "::", "") else host


class Membership:
    """The node's etcd registration for ``serve``: register after the listener is up, publish
    draining, deregister on the way out. ``cluster.discovery: static`` makes it a no-op."""

    def __init__(self, cfg, node, http_host: str, http_port: int, engine):
        self.cfg, self.node, self.engine = cfg, node, engine
        self.url = f"http://{advertised_host(http_host)}:{http_port}"
        self.reg = None
        cl = cfg.cluster
        self.node_id = cl.node_id or f"{advertised_host(http_host)}-{http_port}"

    def record(self) -> dict:
        cfg, eng = self.cfg, self.engine
        rec = {"http": self.url, "parallel": {"tp": cfg.parallel.tp},
               "capacity": {"num_pages": eng.allocator.num_total, "max_num_seqs": cfg.scheduler.max_num_seqs,
                            "max_num_batched_tokens": cfg.scheduler.max_num_batched_tokens},
               "model_fingerprint": "", "model": getattr(eng, "model_name", "")}
        extra = getattr(self.node, "fleet_record", None)
        if extra is not None:  # the disaggregated roles: fingerprint and KV geometry (what HELLO
            rec.update(extra())  # checks), control and transport addresses, NICs
        return rec

    async def start(self) -> None:
        from pdkv.fleet.registry import Registration  # noqa: PLC0415

        cl = self.cfg.cluster
        if cl.discovery != "etcd":
            return
        ttl = cl.lease_ttl_s or max(2, round(self.cfg.messenger.lease_s))
        self.reg = Registration(cl, self.cfg.role, self.node_id, self.record(), ttl)
        await self.reg.start(cl.required, cl.connect_timeout_s)

    async def draining(self) -> None:
        if self.reg is not None:
            await self.reg.set_state("draining")

    async def stop(self) -> None:
        if self.reg is not None:
            await self.reg.stop()
            self.reg = None
