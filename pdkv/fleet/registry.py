"""Fleet membership on etcd: a node's registration under a lease, and watching a role's nodes.

Keys: ``<etcd.prefix>/<cluster.name>/<role>/<node_id>``, each value one JSON record (below),
attached to the node's lease. The lease's keep-alive runs every TTL/3; a node that dies stops
refreshing it and etcd deletes its key after the TTL, which every watcher sees as a leave.

etcd is a directory, never the trust anchor: a decode node that finds a prefill node there dials
it through the authenticated control handshake (cluster secret, HELLO's model and KV checks), so
a key written by someone without the secret gets no connection. Records are still checked here:
a malformed key or value is ignored (logged once per key), a record of another model fingerprint
is ignored with both fingerprints logged, and a node id registered twice is refused at start-up.

etcd unreachable: registered nodes keep serving and watchers keep the nodes they know; the
outage is logged once, and when etcd answers again the registration is renewed (a new lease if
the old one ended meanwhile) and every watcher lists its prefix again (a full resync: nodes that
left meanwhile are dropped, new ones join).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import secrets
import time
from typing import Callable

from pdkv.fleet.etcd import EtcdClient, EtcdError, EtcdUnavailable

log = logging.getLogger("pdkv.fleet")
RECORD_VERSION = 1
STATES = ("ready", "draining")
REQUIRED = {"role": str, "node_id": str, "state": str, "model_fingerprint": str, "http": str}
RESYNC_FIRST_S, RESYNC_MAX_S = 0.2, 2.0


class FleetError(RuntimeError):
    """A fleet problem a node cannot start with (etcd unreachable while required, a taken node id)."""


def client_from(cl) -> EtcdClient:
    """An EtcdClient from the ``cluster`` config section."""
    e = cl.etcd
    return EtcdClient(e.endpoints, ca=e.ca, cert=e.cert, key=e.key, user=e.user, password=e.password,
                      timeout_s=e.timeout_s)


def role_prefix(cl, role: str) -> str:
    return f"{cl.etcd.prefix}/{cl.name}/{role}/"


def parse_record(prefix: str, key: bytes, value: bytes) -> tuple[str, dict]:
    """(node_id, record) of one key under ``prefix``; ValueError naming what is wrong."""
    try:
        k = key.decode()
    except UnicodeDecodeError:
        raise ValueError(f"key {key!r} is not UTF-8") from None
    node_id = k[len(prefix):] if k.startswith(prefix) else ""
    if not node_id or "/" in node_id:
        raise ValueError(f"key {k!r} is not {prefix}<node_id>")
    try:
        rec = json.loads(value)
    except ValueError as e:
        raise ValueError(f"key {k!r}: the value is not JSON ({e})") from None
    if not isinstance(rec, dict):
        raise ValueError(f"key {k!r}: the value is not a JSON object")
    for name, t in REQUIRED.items():
        if not isinstance(rec.get(name), t):
            raise ValueError(f"key {k!r}: field {name!r} missing or not a {t.__name__}")
    if rec["node_id"] != node_id:
        raise ValueError(f"key {k!r}: its record names node {rec['node_id']!r}")
    if rec["state"] not in STATES:
        raise ValueError(f"key {k!r}: state {rec['state']!r} is not one of {', '.join(STATES)}")
    return node_id, rec


class Registration:
    """This node's key under a lease, refreshed until ``stop()`` (which deletes it)."""

    def __init__(self, cl, role: str, node_id: str, record: dict, ttl_s: int):
        self.cl, self.client = cl, client_from(cl)
        self.key = (role_prefix(cl, role) + node_id).encode()
        self.instance = secrets.token_hex(8)  # tells our own key from another process's
        self.record = {"v": RECORD_VERSION, "role": role, "node_id": node_id, "state": "ready",
                       "instance": self.instance, "pid": os.getpid(), **record}
        self.ttl_s = max(2, int(ttl_s))
        self.lease = 0
        self.registered = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._down_since: float | None = None  # etcd unreachable since (logged once per outage)
        self._stopping = False

    async def start(self, required: bool, timeout_s: float) -> None:
        """Register within ``timeout_s``; FleetError if the id is taken, or if etcd did not answer
        and ``required`` (else registration goes on in the background)."""
        deadline = time.monotonic() + timeout_s
        last: Exception | None = None
        while time.monotonic() < deadline:
            try:
                await self._register()
                break
            except EtcdUnavailable as e:
                last = e
                await asyncio.sleep(min(0.2, max(0.0, deadline - time.monotonic())))
        else:
            if required:
                await self.client.close()
                raise FleetError(f"etcd did not answer within {timeout_s} s (cluster.connect_timeout_s): {last}; "
                                 f"set cluster.required: false to start without it")
            self._outage(last)
        self._task = asyncio.get_running_loop().create_task(self._keep())

    async def _register(self) -> None:
        self.lease = await self.client.grant(self.ttl_s)
        held = await self.client.create(self.key, json.dumps(self.record).encode(), self.lease)
        if held is not None:
            await self.client.revoke(self.lease)
            self.lease = 0
            try:
                other = json.loads(held.value)
                who = f"pid {other.get('pid')} serving {other.get('http')}"
            except ValueError:
                who = "a record pdkv cannot read"
            raise FleetError(f"node id {self.record['node_id']!r} is already registered in etcd "
                             f"({self.key.decode()}, by {who}); give each node its own cluster.node_id")
        self.registered.set()
        log.info("fleet: registered %s (lease %x, ttl %d s)", self.key.decode(), self.lease, self.ttl_s)

    def _outage(self, e) -> None:
        if self._down_since is None:
            self._down_since = time.monotonic()
            log.warning("fleet: etcd unreachable (%s); serving on with the peers known, retrying", e)

    def _back(self) -> None:
        if self._down_since is not None:
            log.warning("fleet: etcd answers again after %.1f s", time.monotonic() - self._down_since)
            self._down_since = None

    async def _keep(self) -> None:
        period = self.ttl_s / 3
        while not self._stopping:
            try:
                if not self.registered.is_set():
                    await self._register()
                elif await self.client.keepalive(self.lease) <= 0:  # expired while etcd was away
                    log.warning("fleet: lease of %s ended; registering again", self.key.decode())
                    self.registered.clear()
                    await self._register()
                self._back()
                await asyncio.sleep(period)
            except EtcdUnavailable as e:
                self._outage(e)
                await asyncio.sleep(min(period, 0.5))
            except (EtcdError, FleetError) as e:  # e.g. our id taken by another node meanwhile
                log.error("fleet: %s", e)
                await asyncio.sleep(period)

    async def set_state(self, state: str) -> None:
        """Publish ``state`` (ready | draining); etcd unreachable: logged, kept for the next put."""
        self.record["state"] = state
        if self.registered.is_set():
            try:
                await self.client.put(self.key, json.dumps(self.record).encode(), self.lease)
            except EtcdError as e:
                self._outage(e)

    async def stop(self) -> None:
        """Deregister (revoke the lease: the key goes at once) and close."""
        self._stopping = True
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        if self.lease:
            try:
                await self.client.revoke(self.lease)
                log.info("fleet: deregistered %s", self.key.decode())
            except EtcdError as e:
                log.warning("fleet: could not deregister %s (%s); its lease ends in %d s", self.key.decode(),
                            e, self.ttl_s)
        await self.client.close()


class Watcher:
    """Follows the nodes of one role: ``on_change(node_id, record or None)`` for each join, state
    change and leave, from the event loop. Records of another model fingerprint (``fingerprint``
    given) and malformed keys are ignored, each logged once."""

    def __init__(self, cl, role: str, on_change: Callable[[str, dict | None], None], fingerprint: str | None = None,
                 exclude: str | None = None):
        self.cl, self.client = cl, client_from(cl)
        self.prefix = role_prefix(cl, role)
        self.on_change = on_change
        self.fingerprint = fingerprint
        self.exclude = exclude  # our own node id (a colocated router-side watcher never needs it)
        self.nodes: dict[str, dict] = {}
        self.synced = asyncio.Event()  # the first listing is done
        self.resyncs = 0
        self._ignored: set[tuple] = set()
        self._task: asyncio.Task | None = None
        self._down_since: float | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        await self.client.close()

    def _ignore(self, why: tuple, fmt: str, *args) -> None:
        if why not in self._ignored:
            if len(self._ignored) > 4096:  # bounded: a flood of bad keys cannot grow this forever
                self._ignored.clear()
            self._ignored.add(why)
            log.warning(fmt, *args)

    def _accept(self, key: bytes, value: bytes) -> tuple[str, dict] | None:
        try:
            node_id, rec = parse_record(self.prefix, key, value)
        except ValueError as e:
            self._ignore(("bad", key, value[:64]), "fleet: ignoring %s", e)
            return None
        if node_id == self.exclude:
            return None
        if self.fingerprint is not None and rec["model_fingerprint"] != self.fingerprint:
            self._ignore(("fp", key, rec["model_fingerprint"]), "fleet: ignoring node %s (%s): its model fingerprint "
                         "%s is not this node's %s", node_id, rec.get("http"), rec["model_fingerprint"],
                         self.fingerprint)
            return None
        return node_id, rec

    def _set(self, node_id: str, rec: dict | None) -> None:
        old = self.nodes.get(node_id)
        if rec is None:
            if old is None:
                return
            del self.nodes[node_id]
        else:
            if old == rec:
                return
            self.nodes[node_id] = rec
        try:
            self.on_change(node_id, rec)
        except Exception:  # noqa: BLE001 - one bad callback must not end the watch
            log.exception("fleet: handling a change of node %s failed", node_id)

    async def _list(self) -> int:
        kvs, rev = await self.client.get_prefix(self.prefix.encode())
        seen = {}
        for kv in kvs:
            got = self._accept(kv.key, kv.value)
            if got is not None:
                seen[got[0]] = got[1]
        for node_id in [n for n in self.nodes if n not in seen]:  # left while we were not watching
            self._set(node_id, None)
        for node_id, rec in seen.items():
            self._set(node_id, rec)
        self.synced.set()
        return rev

    async def _run(self) -> None:
        delay = RESYNC_FIRST_S
        while True:
            try:
                rev = await self._list()
                if self._down_since is not None:
                    log.warning("fleet: etcd answers again after %.1f s; %s resynced (%d node(s))",
                                time.monotonic() - self._down_since, self.prefix, len(self.nodes))
                    self._down_since = None
                    self.resyncs += 1
                delay = RESYNC_FIRST_S
                async for events in self.client.watch_prefix(self.prefix.encode(), rev + 1):
                    for ev in events:
                        if ev.kind == "delete":
                            k = ev.kv.key.decode(errors="replace")
                            self._set(k[len(self.prefix):], None)
                            continue
                        got = self._accept(ev.kv.key, ev.kv.value)
                        if got is not None:
                            self._set(*got)
                        else:  # a key that turned bad or foreign: whatever it was is gone
                            k = ev.kv.key.decode(errors="replace")
                            self._set(k[len(self.prefix):], None)
            except asyncio.CancelledError:
                raise
            except EtcdError as e:  # unreachable, broken stream, compacted history: list again
                if self._down_since is None:
                    self._down_since = time.monotonic()
                    log.warning("fleet: watching %s failed (%s); keeping the %d node(s) known, retrying",
                                self.prefix, e, len(self.nodes))
                await asyncio.sleep(delay)
                delay = min(2 * delay, RESYNC_MAX_S)
