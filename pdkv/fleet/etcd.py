"""A small asyncio etcd v3 client over etcd's JSON gateway (``POST /v3/...``), on aiohttp.

Why not a gRPC client library: of the maintained ones on PyPI, aetcd (asyncio, grpcio) opens
insecure channels only (no TLS, which cluster.etcd.ca/cert/key need), etcd3 has had no release
since 2020 and does not run on current protobuf, etcd3gw (OpenStack, maintained) is synchronous
(requests + threads) on a server whose every part is asyncio, and etcd3aio is a 0.x release of a
few months; every gRPC one also brings grpcio's native core (its own threads, fork caveats) into
a process that forks TP ranks. The gateway is part of every etcd v3 server (3.4+ at /v3), speaks
the same protobuf messages as JSON (bytes base64, int64 as strings), and aiohttp — already
pdkv's HTTP stack — gives TLS, client certificates and bounded timeouts for free.

Only what fleet membership needs: put / range / delete / a create-only transaction, leases
(grant, keep-alive, revoke) and a prefix watch. Every call is bounded by ``timeout_s`` and tried
on each endpoint in turn; ``EtcdUnavailable`` says that none answered.
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import ssl
from dataclasses import dataclass
from typing import AsyncIterator

import aiohttp

log = logging.getLogger(__name__)


class EtcdError(Exception):
    """etcd answered, with an error (the message is etcd's)."""


class EtcdUnavailable(EtcdError):
    """No endpoint answered (refused, reset, timed out)."""


class _Transient(Exception):
    """An endpoint that answered but cannot serve now: the next one is tried."""


def _b64(b: bytes | str) -> str:
    return base64.b64encode(b.encode() if isinstance(b, str) else b).decode()


def _unb64(s: str | None) -> bytes:
    return base64.b64decode(s) if s else b""


def prefix_end(prefix: bytes) -> bytes:
    """The range end that covers every key starting with ``prefix`` (etcd's convention)."""
    b = bytearray(prefix)
    for i in range(len(b) - 1, -1, -1):
        if b[i] < 0xFF:
            b[i] += 1
            return bytes(b[:i + 1])
    return b"\0"


@dataclass(frozen=True)
class KV:
    key: bytes
    value: bytes
    lease: int
    mod_revision: int


@dataclass(frozen=True)
class Event:
    kind: str  # "put" | "delete"
    kv: KV


def _kv(d: dict) -> KV:
    return KV(_unb64(d.get("key")), _unb64(d.get("value")), int(d.get("lease", 0) or 0),
              int(d.get("mod_revision", 0) or 0))


class EtcdClient:
    def __init__(self, endpoints, *, ca: str = "", cert: str = "", key: str = "", user: str = "",
                 password: str = "", timeout_s: float = 2.0):
        self.endpoints = [e.rstrip("/") for e in endpoints]
        if not self.endpoints:
            raise ValueError("etcd: no endpoints")
        self.timeout_s = timeout_s
        self._ssl: ssl.SSLContext | None = None
        if ca or cert:
            self._ssl = ssl.create_default_context(cafile=ca or None)
            if cert:
                self._ssl.load_cert_chain(cert, key)
        self.user, self.password = user, password
        self._token: str | None = None
        self._session: aiohttp.ClientSession | None = None
        self._next = 0  # the endpoint tried first (the last that answered)

    async def __aenter__(self) -> "EtcdClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    def _sess(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=self._ssl, limit=0))
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def _authenticate(self, base: str) -> None:
        async with self._sess().post(base + "/v3/auth/authenticate", json={"name": self.user,
                                     "password": self.password},
                                     timeout=aiohttp.ClientTimeout(total=self.timeout_s)) as r:
            body = await r.json(content_type=None)
            if r.status != 200 or "token" not in body:
                raise EtcdError(f"etcd at {base}: authentication as {self.user!r} failed: "
                                f"{body.get('message') or body.get('error') or r.status}")
            self._token = body["token"]

    def _headers(self) -> dict:
        return {"Authorization": self._token} if self._token else {}

    async def call(self, path: str, body: dict) -> dict:
        """One unary call, on each endpoint in turn until one answers (bounded by timeout_s each)."""
        errors = []
        n = len(self.endpoints)
        for i in range(n):
            base = self.endpoints[(self._next + i) % n]
            try:
                for attempt in range(2):  # a token that expired: authenticate again once
                    if self.user and self._token is None:
                        await self._authenticate(base)
                    async with self._sess().post(base + path, json=body, headers=self._headers(),
                                                 timeout=aiohttp.ClientTimeout(total=self.timeout_s)) as r:
                        out = await r.json(content_type=None)
                    if r.status == 200:
                        self._next = (self._next + i) % n
                        return out if isinstance(out, dict) else {}
                    msg = str(out.get("message") or out.get("error") or out) if isinstance(out, dict) else str(out)
                    if self.user and attempt == 0 and ("token" in msg or "auth" in msg):
                        self._token = None
                        continue
                    if r.status == 408 or r.status >= 500:  # a member shutting down or without a leader
                        raise _Transient(f"{path} answered {r.status}: {msg}")
                    raise EtcdError(f"etcd at {base}: {path} answered {r.status}: {msg}")
            except (aiohttp.ClientError, asyncio.TimeoutError, OSError, ValueError, _Transient) as e:
                errors.append(f"{base}: {type(e).__name__}: {e}".rstrip(": "))
        raise EtcdUnavailable("no etcd endpoint answered (" + "; ".join(errors) + ")")

    # ---- keys ------------------------------------------------------------------------------
    async def put(self, key: bytes, value: bytes, lease: int = 0) -> None:
        await self.call("/v3/kv/put", {"key": _b64(key), "value": _b64(value),
                                       **({"lease": str(lease)} if lease else {})})

    async def create(self, key: bytes, value: bytes, lease: int = 0) -> KV | None:
        """Put ``key`` only if it does not exist; None when it was created, else the KV there."""
        put = {"key": _b64(key), "value": _b64(value), **({"lease": str(lease)} if lease else {})}
        out = await self.call("/v3/kv/txn", {
            "compare": [{"key": _b64(key), "target": "CREATE", "result": "EQUAL", "create_revision": "0"}],
            "success": [{"request_put": put}], "failure": [{"request_range": {"key": _b64(key)}}]})
        if out.get("succeeded"):
            return None
        for resp in out.get("responses", []):
            kvs = resp.get("response_range", {}).get("kvs", [])
            if kvs:
                return _kv(kvs[0])
        return KV(key, b"", 0, 0)  # deleted between the compare and the range: someone held it

    async def get_prefix(self, prefix: bytes) -> tuple[list[KV], int]:
        """Every KV under ``prefix`` and the store's revision at that moment."""
        out = await self.call("/v3/kv/range", {"key": _b64(prefix), "range_end": _b64(prefix_end(prefix))})
        return [_kv(d) for d in out.get("kvs", [])], int(out.get("header", {}).get("revision", 0))

    async def delete(self, key: bytes) -> None:
        await self.call("/v3/kv/deleterange", {"key": _b64(key)})

    # ---- leases ----------------------------------------------------------------------------
    async def grant(self, ttl_s: int) -> int:
        out = await self.call("/v3/lease/grant", {"TTL": str(int(ttl_s))})
        if "error" in out and out["error"]:
            raise EtcdError(f"etcd: lease grant failed: {out['error']}")
        return int(out["ID"])

    async def keepalive(self, lease: int) -> int:
        """Refresh ``lease``; its TTL now (0: it has expired, its keys are gone)."""
        out = await self.call("/v3/lease/keepalive", {"ID": str(lease)})
        return int((out.get("result") or {}).get("TTL", 0) or 0)

    async def revoke(self, lease: int) -> None:
        await self.call("/v3/lease/revoke", {"ID": str(lease)})

    # ---- watch -----------------------------------------------------------------------------
    async def watch_prefix(self, prefix: bytes, start_revision: int) -> AsyncIterator[list[Event]]:
        """Batches of events under ``prefix`` from ``start_revision`` on, until the stream breaks
        (EtcdUnavailable) or the caller stops iterating. Compacted history: EtcdError."""
        body = {"create_request": {"key": _b64(prefix), "range_end": _b64(prefix_end(prefix)),
                                   "start_revision": str(start_revision)}}
        base = self.endpoints[self._next % len(self.endpoints)]
        try:
            if self.user and self._token is None:
                await self._authenticate(base)
            # no total bound: a watch lasts; sock_read bounds a stream whose server went silent
            # (etcd sends progress notifications only when asked, so idle streams are re-opened)
            timeout = aiohttp.ClientTimeout(total=None, sock_connect=self.timeout_s, sock_read=None)
            async with self._sess().post(base + "/v3/watch", json=body, headers=self._headers(),
                                         timeout=timeout) as r:
                if r.status != 200:
                    raise EtcdError(f"etcd at {base}: watch answered {r.status}: {(await r.text())[:200]}")
                async for line in r.content:
                    line = line.strip()
                    if not line:
                        continue
                    msg = json.loads(line)
                    if "error" in msg:
                        raise EtcdUnavailable(f"etcd at {base}: watch ended: {msg['error']}")
                    res = msg.get("result") or {}
                    if res.get("compact_revision") and int(res["compact_revision"]) > 0:
                        raise EtcdError(f"etcd: watch from revision {start_revision} was compacted "
                                        f"(now {res['compact_revision']})")
                    if res.get("canceled"):
                        raise EtcdUnavailable(f"etcd at {base}: watch cancelled: {res.get('cancel_reason', '')}")
                    evs = [Event("delete" if e.get("type") == "DELETE" else "put", _kv(e.get("kv") or {}))
                           for e in res.get("events") or []]
                    if evs:
                        yield evs
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError, ValueError) as e:
            raise EtcdUnavailable(f"etcd at {base}: watch broke: {type(e).__name__}: {e}") from None
        raise EtcdUnavailable(f"etcd at {base}: watch stream ended")
