"""Starting, killing and restarting the nodes of one architecture as ``python -m pdkv serve``
processes (one per node, each in its own session so a kill takes its tensor-parallel ranks too).

The harness only talks to nodes over HTTP (/health, /metrics, /v1/completions): what it measures
is what a client and an operator would see. Ports are chosen here (free loopback ports), so a
restarted node comes back on the same API and control ports and decode nodes redial it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import yaml

from pdkv.bench.ab.archs import ArchSpec, NodeSpec, node_specs
from pdkv.ports import free_port


class LaunchError(RuntimeError):
    """An architecture that did not come up; the message names the node and its log."""




def get_json(url: str, timeout: float = 5.0) -> dict:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return json.loads(r.read())


class NodeProc:
    def __init__(self, spec: NodeSpec, workdir: Path, sets: list[str]):
        self.spec, self.name, self.role = spec, spec.name, spec.role
        self.port = spec.config["server"]["port"]
        self.url = f"http://127.0.0.1:{self.port}"
        self.cfg_path = workdir / f"{spec.name}.yaml"
        self.cfg_path.write_text(yaml.safe_dump(spec.config, sort_keys=False))
        self.log_path = workdir / f"{spec.name}.log"
        self.sets = sets
        self.forks = None  # pdkv.forkserver.ForkServer: the node is forked from it, not exec'd
        self.proc = None  # subprocess.Popen, or pdkv.forkserver.ForkedChild
        self.num_starts = 0
        self._pids_cache: tuple[int, float, list[int]] = (0, 0.0, [])

    def start(self) -> None:
        cmd = [sys.executable, "-m", "pdkv", "serve", "-c", str(self.cfg_path), "--log-level", "warning"]
        cmd += [a for o in self.sets for a in ("--set", o)]
        log = open(self.log_path, "ab")
        log.write(f"--- start {self.num_starts}{' (forked)' if self.forks else ''}: {' '.join(cmd)}\n".encode())
        log.flush()
        if self.forks is not None:  # cmd[3:]: the pdkv arguments after `python -m pdkv`
            log.close()
            self.proc = self.forks.spawn(cmd[3:], dict(os.environ), str(self.log_path))
        else:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
            log.close()
        self.num_starts += 1

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def health(self, timeout: float = 5.0) -> dict:
        return get_json(self.url + "/health", timeout)

    def ready(self) -> bool:
        """Healthy, and (decode) connected to every prefill peer."""
        try:
            h = self.health(2.0)
        except (OSError, ValueError):
            return False
        return h.get("status") == "ok" and all(p.get("connected") for p in h.get("prefill_peers", ()))

    def wait_ready(self, timeout: float) -> None:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if not self.alive():
                raise LaunchError(f"node {self.name} exited with status {self.proc.returncode} before it was "
                                  f"ready; its log ({self.log_path}) ends: {self.log_tail()}")
            if self.ready():
                return
            time.sleep(0.1)
        raise LaunchError(f"node {self.name} was not ready at {self.url}/health after {timeout:.0f} s "
                          f"(log {self.log_path})")

    def log_tail(self, n: int = 600) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-n:].strip()
        except OSError:
            return "(no log)"

    def kill(self) -> None:
        """SIGKILL the node and everything in its session (fault injection)."""
        if self.alive():
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait(10)

    def stop(self) -> None:
        if not self.alive():
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            self.kill()

    def pids(self) -> list[int]:
        """The node's process and its descendants (tensor-parallel ranks); the /proc scan is
        redone at most every 2 s, so sampling costs the shared CPUs little."""
        if not self.alive():
            return []
        now = time.monotonic()
        key, when, pids = self._pids_cache
        if key != self.proc.pid or now - when > 2.0:
            pids = descendants(self.proc.pid)
            self._pids_cache = (self.proc.pid, now, pids)
        return pids


def descendants(root: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                ppid = int(open(f"/proc/{d}/stat").read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(d))
    out, todo = [], [root]
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(children.get(p, ()))
    return out


class Deployment:
    """The running nodes of one architecture; ``api_urls`` are where clients send requests."""

    def __init__(self, spec: ArchSpec, budget: list[int], workdir: Path, model_path: str, served_name: str,
                 sets: list[str]):
        self.spec = spec
        workdir.mkdir(parents=True, exist_ok=True)
        specs = node_specs(spec, budget)
        control = {s.name: free_port() for s in specs if s.role == "prefill"}
        peers = [f"127.0.0.1:{p}" for p in control.values()]
        self.nodes: list[NodeProc] = []
        for s in specs:
            c = s.config
            c.setdefault("model", {}).update(path=model_path, served_name=served_name)
            c.setdefault("server", {}).update(host="127.0.0.1", port=free_port())
            m = c.setdefault("messenger", {})
            if s.role == "prefill":
                m.update(control_host="127.0.0.1", control_port=control[s.name])
            elif s.role == "decode":
                m["prefill_peers"] = peers
            self.nodes.append(NodeProc(s, workdir, sets))
        self.forks = None

    @property
    def api_nodes(self) -> list[NodeProc]:
        return [n for n in self.nodes if n.role != "prefill"]

    @property
    def api_urls(self) -> list[str]:
        return [n.url for n in self.api_nodes]

    def by_role(self, role: str) -> list[NodeProc]:
        return [n for n in self.nodes if n.role == role]

    def start(self, timeout: float = 300.0) -> None:
        """Start every node at once (decode nodes keep dialling their prefill peers for
        messenger.connect_timeout_s while those load), then wait until all are ready."""
        try:
            if self.spec.fork:
                from pdkv.forkserver import ForkError, ForkServer  # noqa: PLC0415

                try:
                    self.forks = ForkServer(timeout)
                except ForkError as e:
                    raise LaunchError(f"{self.spec.name}: the fork server did not start: {e}") from None
            for n in self.nodes:
                n.forks = self.forks
                n.start()
            for n in self.by_role("prefill") + self.api_nodes:
                n.wait_ready(timeout)
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        for n in self.api_nodes + self.by_role("prefill"):  # decode first: it owns the requests
            n.stop()
        if self.forks is not None:
            self.forks.close()
            self.forks = None

    def pids(self) -> list[int]:
        """Every process of the architecture: its nodes' and the parent they were forked from
        (whose imported pages the nodes share: its part of them is the architecture's too)."""
        server = [self.forks.proc.pid] if self.forks is not None and self.forks.proc.poll() is None else []
        return server + [p for n in self.nodes for p in n.pids()]

    def pid_names(self) -> dict[int, str]:
        """{pid: its node's name} (a node's own process; its descendants, TP ranks: name/pid)."""
        out = {self.forks.proc.pid: "forkserver"} if self.forks is not None else {}
        for n in self.nodes:
            for i, p in enumerate(n.pids()):
                out[p] = n.name if i == 0 else f"{n.name}/{p}"
        return out

    def pools(self) -> dict[str, dict]:
        """{node: {"free": n, "total": n}} from every node's /health (None where unreachable)."""
        out = {}
        for n in self.nodes:
            try:
                h = n.health(5.0)
                out[n.name] = {"free": h.get("num_pages_free"), "total": h.get("num_pages_total")}
            except (OSError, ValueError):
                out[n.name] = {"free": None, "total": None}
        return out

    def wait_pools_full(self, timeout: float = 30.0) -> dict[str, dict]:
        """Poll until every pool is back to its start (all pages free), at most ``timeout`` s."""
        end = time.monotonic() + timeout
        pools = self.pools()
        while time.monotonic() < end:
            if all(p["free"] is not None and p["free"] == p["total"] for p in pools.values()):
                break
            time.sleep(0.2)
            pools = self.pools()
        return pools
