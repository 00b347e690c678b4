"""The ``local`` actuator: real ``pdkv serve`` processes on this host, started and drained to the
planner's counts, behind one ``pdkv router`` (what ``pdkv up`` builds, made elastic).

The cluster file is a ``pdkv up`` one (shared sections, ``prefill:`` / ``decode:`` overrides,
``router:``); ``cpus: {prefill: ["0-3", "4-7"], decode: [...]}`` hands each new node of a role
the next CPU set not in use (``parallel.cpus``; several nodes share a set when the list runs
out). Every node gets its own free ports and the cluster's secret through its environment.

Discovery without a coordination service: the router's node list is fixed when it starts, so
every decode slot (up to the role's ``max_nodes``) gets its API port up front; the router polls
them all and takes in each one once its ``/load`` answers (pdkv/router/nodes.py), so a new decode
node serves as soon as it is healthy. A new decode node dials the prefill nodes that are ready
when it starts. Decode nodes that are already running learn of a new prefill node only through
``cluster.discovery: etcd`` (the nodes' own registry: put it in the cluster file); with static
lists only the decode nodes started after it use it.

Scale-in drains: SIGTERM (a node's drain: it takes nothing new, finishes what it has, exits 0),
then waits up to ``drain_timeout_s`` for the exit before it kills. The node drained is the
role's least loaded, the newest of equals; never a role's last ready node (while the count is
above the plan because a node is still loading, the drain waits until it is ready).
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from pdkv.auth import SECRET_ENV, new_secret
from pdkv.config import ConfigError, _read_yaml, load_config
from pdkv.ports import free_port

log = logging.getLogger("pdkv.planner.local")
ROLES = ("prefill", "decode")


def _merge(base: dict, over: dict) -> dict:
    out = dict(base)
    for k, v in (over or {}).items():
        out[k] = _merge(out.get(k) or {}, v) if isinstance(v, dict) else v
    return out


@dataclass
class LocalNode:
    name: str
    role: str
    url: str
    proc: subprocess.Popen
    cpus: str | None
    control: str | None = None  # prefill: host:port decode nodes dial
    state: str = "starting"  # starting -> ready -> draining -> gone
    started: float = field(default_factory=time.monotonic)
    drain_started: float | None = None
    in_flight: int = 0
    exit_code: int | None = None


class LocalActuator:
    def __init__(self, cluster: str, max_nodes: dict, cpus: dict | None = None, overrides: list[str] | None = None,
                 start_timeout_s: float = 120.0, drain_timeout_s: float = 60.0, log_level: str | None = None,
                 workdir: str | None = None):
        self.cluster = cluster
        data = _read_yaml(Path(cluster))
        self.sections = {r: data.pop(r, None) or {} for r in ROLES}
        self.router_sec = data.pop("router", None) or {}
        data.pop("role", None)
        for r in ROLES:
            self.sections[r].pop("replicas", None)
        self.shared = data
        self.overrides = list(overrides or [])
        self.cpus = {r: list((cpus or {}).get(r) or []) for r in ROLES}
        self.max_nodes = dict(max_nodes)
        self.start_timeout_s = start_timeout_s
        self.drain_timeout_s = drain_timeout_s
        self.log_level = log_level
        self._tmp = tempfile.TemporaryDirectory(prefix="pdkv-planner-") if workdir is None else None
        self.workdir = Path(workdir or self._tmp.name)
        self.env = dict(os.environ)
        self.env.setdefault(SECRET_ENV, new_secret())
        self.nodes: list[LocalNode] = []
        self.router: subprocess.Popen | None = None
        self.api: tuple[str, int] | None = None
        self._seq = {r: 0 for r in ROLES}
        self._decode_ports: list[int] = []
        self._extra: list[str] = []
        self.events: list[dict] = []  # what it did, for /plan and the tests

    # ---- set-up ----
    def _node_config(self, role: str, port: int, cpus: str | None) -> tuple[Path, list[str], object]:
        d = _merge(self.shared, self.sections[role])
        d["role"] = role
        m = d.setdefault("messenger", {})
        s = d.setdefault("server", {})
        s["port"] = port
        if role == "prefill":
            m["control_port"] = free_port(m.get("control_host", "127.0.0.1"))
        else:
            peers = [n.control for n in self.nodes if n.role == "prefill" and n.state == "ready"]
            m["prefill_peers"] = peers
        if cpus is not None:
            d.setdefault("parallel", {})["cpus"] = cpus
        self._seq[role] += 1
        name = f"{role}-{self._seq[role] - 1}"
        f = self.workdir / f"{name}.yaml"
        f.write_text(yaml.safe_dump(d, sort_keys=False))
        sets = [o for o in self.overrides if not o.startswith("server.")] + self._extra
        try:
            cfg = load_config(f, sets)
        except ConfigError as e:
            raise ConfigError(str(e).replace(str(f), f"{self.cluster} ({role} node)")) from None
        return f, sets, cfg

    def _spawn(self, args: list[str]) -> subprocess.Popen:
        if self.log_level:
            args = args + ["--log-level", self.log_level]
        return subprocess.Popen([sys.executable, "-m", "pdkv"] + args, start_new_session=True, env=self.env)

    def _free_cpus(self, role: str) -> str | None:
        sets = self.cpus[role]
        if not sets:
            return None
        used = [n.cpus for n in self.nodes if n.role == role and n.state != "gone"]
        for c in sets:
            if c not in used:
                return c
        return min(sets, key=used.count)  # all taken: share the least shared

    async def start(self, initial: dict) -> None:
        """The router (every decode slot's port reserved) and the initial nodes, ready."""
        if not self.shared.get("model", {}).get("path"):
            from pdkv.default_model import ensure_default_model

            self._extra = [f"model.path={ensure_default_model()}"]
        srv = _merge(self.shared.get("server") or {}, {})
        host = srv.get("host", "127.0.0.1")
        port = int(next((o.split("=", 1)[1] for o in self.overrides if o.startswith("server.port=")),
                        srv.get("port", 8000)))
        self.api = (host, port)
        self._decode_ports = [free_port(host) for _ in range(self.max_nodes["decode"])]
        rd = {**self.router_sec, "host": host, "port": port,
              "nodes": [f"http://{host}:{p}" for p in self._decode_ports]}
        rf = self.workdir / "router.yaml"
        rf.write_text(yaml.safe_dump(rd, sort_keys=False))
        from pdkv.config.router import load_router_config

        load_router_config(rf)
        for role in ROLES:  # prefill first: the decode nodes dial them
            for _ in range(initial.get(role, 1)):
                self._start_node(role)
            await self._wait_ready(role)
        self.router = self._spawn(["router", "-c", str(rf)])
        await self._wait_url(f"http://{host}:{port}/health", self.router, "router")

    def _start_node(self, role: str) -> LocalNode:
        host = (self.shared.get("server") or {}).get("host", "127.0.0.1")
        if role == "decode":
            taken = {int(n.url.rsplit(":", 1)[1]) for n in self.nodes if n.role == "decode" and n.state != "gone"}
            port = next(p for p in self._decode_ports if p not in taken)
        else:
            port = free_port(host)
        cpus = self._free_cpus(role)
        f, sets, cfg = self._node_config(role, port, cpus)
        proc = self._spawn(["serve", "-c", str(f)] + [a for o in sets for a in ("--set", o)])
        node = LocalNode(f.stem, role, f"http://{cfg.server.host}:{cfg.server.port}", proc, cpus,
                         control=(f"{cfg.messenger.control_host}:{cfg.messenger.control_port}"
                                  if role == "prefill" else None))
        self.nodes.append(node)
        self._event("start", node)
        log.info("started %s (pid %d) at %s, cpus %s", node.name, proc.pid, node.url, cpus or "any")
        return node

    async def _wait_url(self, url: str, proc: subprocess.Popen, what: str) -> None:
        import aiohttp

        end = time.monotonic() + self.start_timeout_s
        async with aiohttp.ClientSession() as s:
            while time.monotonic() < end:
                if proc.poll() is not None:
                    raise RuntimeError(f"the {what} exited with status {proc.returncode} before it was healthy")
                try:
                    async with s.get(url, timeout=aiohttp.ClientTimeout(total=2)) as r:
                        if r.status == 200:
                            return
                except (aiohttp.ClientError, asyncio.TimeoutError, OSError):
                    pass
                await asyncio.sleep(0.2)
        raise RuntimeError(f"the {what} was not healthy at {url} after {self.start_timeout_s:.0f} s")

    async def _wait_ready(self, role: str) -> None:
        for n in [n for n in self.nodes if n.role == role and n.state == "starting"]:
            await self._wait_url(n.url + "/health", n.proc, f"{n.name} node")
            n.state = "ready"
            self._event("ready", n)

    def _event(self, what: str, node: LocalNode) -> None:
        self.events.append({"t": time.time(), "event": what, "node": node.name, "role": node.role,
                            "pid": node.proc.pid, "exit_code": node.exit_code})

    # ---- each interval ----
    def targets(self) -> list[tuple[str, str]]:
        """(role, url) of the nodes to observe: ready and draining ones (their work still counts)."""
        return [(n.role, n.url) for n in self.nodes if n.state in ("ready", "draining")]

    def counts(self) -> dict:
        return {r: sum(1 for n in self.nodes if n.role == r and n.state in ("starting", "ready")) for r in ROLES}

    async def _tick(self) -> None:
        import aiohttp

        async with aiohttp.ClientSession() as s:
            for n in self.nodes:
                if n.state == "starting":
                    if n.proc.poll() is not None:
                        n.state, n.exit_code = "gone", n.proc.returncode
                        self._event("failed", n)
                        log.error("%s exited with status %s while starting", n.name, n.exit_code)
                        continue
                    try:
                        async with s.get(n.url + "/health", timeout=aiohttp.ClientTimeout(total=1)) as r:
                            if r.status == 200:
                                n.state = "ready"
                                self._event("ready", n)
                    except (aiohttp.ClientError, asyncio.TimeoutError, OSError):
                        if time.monotonic() - n.started > self.start_timeout_s:
                            self._kill(n, "did not become healthy")
                elif n.state == "ready":
                    try:
                        async with s.get(n.url + "/load", timeout=aiohttp.ClientTimeout(total=1)) as r:
                            body = await r.json()
                            n.in_flight = int(body.get("in_flight", 0)) + int(body.get("num_running", 0)) \
                                + int(body.get("num_waiting", 0))
                    except (aiohttp.ClientError, asyncio.TimeoutError, OSError, ValueError):
                        pass
                elif n.state == "draining":
                    code = n.proc.poll()
                    if code is not None:
                        n.state, n.exit_code = "gone", code
                        self._event("exited", n)
                        log.info("%s drained: exit status %d after %.1f s", n.name, code,
                                 time.monotonic() - n.drain_started)
                    elif time.monotonic() - n.drain_started > self.drain_timeout_s:
                        self._kill(n, f"still running {self.drain_timeout_s:.0f} s after SIGTERM")

    def _kill(self, n: LocalNode, why: str) -> None:
        log.error("%s %s: killing it", n.name, why)
        n.proc.kill()
        n.exit_code = n.proc.wait()
        n.state = "gone"
        self._event("killed", n)

    def _drain(self, n: LocalNode) -> None:
        n.state, n.drain_started = "draining", time.monotonic()
        n.proc.send_signal(signal.SIGTERM)
        self._event("drain", n)
        log.info("draining %s (pid %d, %d in flight)", n.name, n.proc.pid, n.in_flight)

    async def apply(self, desired: dict) -> None:
        await self._tick()
        for role in ("decode", "prefill"):
            have = [n for n in self.nodes if n.role == role and n.state in ("starting", "ready")]
            want = desired[role]
            for _ in range(want - len(have)):
                self._start_node(role)
            if len(have) > want:
                # only ready nodes are drained: one still loading is left to finish its start (a
                # signal then could end it mid-set-up, not in a drain) and drained on a later interval
                ready = [n for n in have if n.state == "ready"]
                extra = len(have) - want
                ready.sort(key=lambda n: (n.in_flight, -n.started))
                # never the role's last ready node: the one replacing it may still be loading
                for n in ready[:max(0, min(extra, len(ready) - 1))]:
                    self._drain(n)

    async def close(self) -> None:
        """Stop everything: the router, then decode nodes, then prefill nodes (as `pdkv up`)."""
        groups = [[self.router] if self.router else [],
                  [n.proc for n in self.nodes if n.role == "decode"],
                  [n.proc for n in self.nodes if n.role == "prefill"]]
        for group in groups:
            live = [p for p in group if p.poll() is None]
            for p in live:
                p.send_signal(signal.SIGTERM)
            for p in live:
                try:
                    await asyncio.get_running_loop().run_in_executor(None, p.wait, 30)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
        if self._tmp is not None:
            self._tmp.cleanup()
