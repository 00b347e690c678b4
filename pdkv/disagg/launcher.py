"""``pdkv up``: a local disaggregated cluster (one prefill + one decode node) on loopback.

The cluster file holds the settings both nodes share at the top level (model, kv_cache,
scheduler, server, messenger) plus a ``prefill:`` and a ``decode:`` section whose keys override
the shared ones for that node. Each node is a ``pdkv serve`` subprocess with its own role config
(written into a temporary folder). ``--set`` applies to both nodes, except ``server.*``, which
is the decode node's API (the prefill node's ports come from its section); ``--set
prefill.server.port=8101`` / ``--set decode.X=Y`` set one node only.
The decode node's ``messenger.prefill_peers`` is filled in from the prefill node's control port.

The seed's shape (one prefill node, about three decode nodes): ``decode: {replicas: 3}`` (and
``prefill: {replicas: N}``) start that many nodes of the role, each on free ports (API and, for
prefill, control), every decode node dialling every prefill node; with more than one decode
node a ``pdkv router`` (pdkv/router) serves the API at ``server.host:server.port`` in front of
them, its settings from an optional top-level ``router:`` section (policy, balance_abs, ...).
All of them stop on Ctrl-C: the router first, then decode, then prefill nodes.

Each cluster gets a fresh secret (pdkv/auth.py) in every node's environment, so the nodes
authenticate each other and nothing else on the host can pose as one.
"""

from __future__ import annotations

import copy
import logging
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from pdkv.auth import SECRET_ENV, new_secret
from pdkv.config import ConfigError, _read_yaml, load_config
from pdkv.forkserver import ForkError, ForkServer, fork_enabled
from pdkv.ports import free_port as _free_port

log = logging.getLogger("pdkv.up")
ROLES = ("prefill", "decode")


def _merge(base: dict, over: dict) -> dict:
    out = copy.deepcopy(base)
    for k, v in (over or {}).items():
        out[k] = _merge(out.get(k) or {}, v) if isinstance(v, dict) else v
    return out




MAX_REPLICAS = 16


def _replicas(path: str, role: str, sec: dict) -> int:
    n = sec.pop("replicas", 1)
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_REPLICAS:
        raise ConfigError(f"{path}: {role}.replicas must be an integer 1..{MAX_REPLICAS}, got {n!r}")
    return n


def role_configs(path: str, overrides: list[str], workdir: Path) -> dict:
    """{node name: (yaml path, overrides, Config)}, prefill nodes first: "prefill" / "decode"
    with one replica each, else "prefill-0", "decode-0", ...; ConfigError names the file, the node
    and the field. With several decode nodes, ``workdir/router.yaml`` is written too (see up)."""
    import yaml

    data = _read_yaml(Path(path))
    sections = {r: data.pop(r, None) or {} for r in ROLES}
    router = data.pop("router", None) or {}
    for r, sec in sections.items():
        if not isinstance(sec, dict):
            raise ConfigError(f"{path}: {r} must be a mapping of sections to override for the {r} node")
    if not isinstance(router, dict):
        raise ConfigError(f"{path}: router must be a mapping of router settings (see configs/router.yaml)")
    replicas = {r: _replicas(path, r, sections[r]) for r in ROLES}
    fork_enabled(data.pop("fork", None), path)  # how the nodes start (up), not a node setting
    if data.pop("role", "disaggregated") not in ("disaggregated",):
        raise ConfigError(f"{path}: role must be 'disaggregated' (or absent) in a `pdkv up` cluster file")
    out = {}
    def sets_for(role: str) -> list[str]:
        out = []
        for o in overrides:
            o = o.strip()
            scope = o.split(".", 1)[0]
            if scope in ROLES:
                if scope == role:
                    out.append(o.split(".", 1)[1])
            elif role == "decode" or not o.startswith("server."):
                out.append(o)
        return out

    api = None  # (host, port) of the API the user sees: the decode node's, or the router's
    for role in ROLES:
        n = replicas[role]
        for i in range(n):
            name = role if n == 1 else f"{role}-{i}"
            d = _merge(data, sections[role])
            d["role"] = role
            m = d.setdefault("messenger", {})
            # every node runs on this host: one copy of the weights (pdkv/shared_weights.py) and KV
            # handed over through shared memory, unless the file says otherwise. auto, not shm: the
            # HELLOs find the peers on this host and take shm (pdkv/csrc/auto.c), and memory shm
            # cannot share (a full shm_dir, TP ranks' files without CAP_CHECKPOINT_RESTORE) or a
            # peer elsewhere goes through tcp, with a warning, where shm would refuse to start
            m.setdefault("transport", "auto")
            d.setdefault("model", {}).setdefault("share_weights", "auto")
            if role == "prefill" and (n > 1 or not m.get("control_port")):
                m["control_port"] = _free_port(m.get("control_host", "127.0.0.1"))
            if role == "decode":
                peers = [f"{c.messenger.control_host}:{c.messenger.control_port}"
                         for _, _, c in out.values() if c.role == "prefill"]
                m.setdefault("prefill_peers", peers)
            f = workdir / f"{name}.yaml"
            f.write_text(yaml.safe_dump(d, sort_keys=False))
            sets = sets_for(role)
            try:
                cfg = load_config(f, sets)
                if n > 1:  # replicas: each its own free API port (the section's is the router's)
                    if role == "decode" and api is None:
                        api = (cfg.server.host, cfg.server.port)
                    sets = sets + [f"server.port={_free_port(cfg.server.host)}"]
                    cfg = load_config(f, sets)
            except ConfigError as e:
                raise ConfigError(str(e).replace(str(f), f"{path} ({role} node{f' {i}' if n > 1 else ''})")) from None
            out[name] = (f, sets, cfg)
    if api is not None:
        from pdkv.config.router import load_router_config

        rd = {**router, "host": api[0], "port": api[1],
              "nodes": [f"http://{c.server.host}:{c.server.port}" for _, _, c in out.values() if c.role == "decode"]}
        rf = workdir / "router.yaml"
        rf.write_text(yaml.safe_dump(rd, sort_keys=False))
        try:
            load_router_config(rf)
        except ConfigError as e:
            raise ConfigError(str(e).replace(str(rf), f"{path} (router)")) from None
    return out


def _healthy(cfg, proc, timeout: float) -> None:
    url = f"http://{cfg.server.host}:{cfg.server.port}/health"
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise RuntimeError(f"the {cfg.role} node exited with status {proc.returncode} before it was healthy")
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(0.2)
    raise RuntimeError(f"the {cfg.role} node was not healthy at {url} after {timeout:.0f} s")


def _router_ready(host: str, port: int, num_nodes: int, proc, timeout: float) -> None:
    """Wait until the router answers /health with every decode node in."""
    import json

    url = f"http://{host}:{port}/health"
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise RuntimeError(f"the router exited with status {proc.returncode} before it was ready")
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if json.loads(r.read()).get("num_healthy") == num_nodes:
                    return
        except OSError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"the router at {url} did not see all {num_nodes} decode nodes healthy after {timeout:.0f} s")


def up(path: str, overrides: list[str], log_level: str | None = None, timeout: float = 300.0) -> int:
    """Start both nodes, wait until healthy, serve until SIGINT/SIGTERM or a node exits."""
    with tempfile.TemporaryDirectory(prefix="pdkv-up-") as tmp:
        nodes = role_configs(path, list(overrides), Path(tmp))
        router_file = Path(tmp) / "router.yaml"
        extra: list[str] = []
        if not next(iter(nodes.values()))[2].model.path:  # build the embedded model once, not in every node
            from pdkv.default_model import ensure_default_model

            extra = [f"model.path={ensure_default_model()}"]
        stop = {"sig": None}

        def on_signal(sig, _frame):
            stop["sig"] = sig
        old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
        procs: dict = {}  # name -> subprocess.Popen, or pdkv.forkserver.ForkedChild
        # One secret per cluster, handed to the nodes through their environment (never argv, which
        # `ps` shows); an operator's own $PDKV_CLUSTER_SECRET is kept.
        env = dict(os.environ)
        env.setdefault(SECRET_ENV, new_secret())
        forks = None
        if fork_enabled(_read_yaml(Path(path)).get("fork"), path):
            try:  # the nodes forked from one parent that imported torch and pdkv: those pages shared
                forks = ForkServer(timeout, env)
            except ForkError as e:
                log.warning("starting the nodes as separate processes (fork: false): %s", e)

        def spawn(name: str, cmd: list[str]) -> None:
            if log_level:
                cmd += ["--log-level", log_level]
            if forks is not None:  # cmd[3:]: the pdkv arguments after `python -m pdkv`
                procs[name] = forks.spawn(cmd[3:], env)
                return
            # own process group: a terminal's Ctrl-C reaches `pdkv up`, which stops the nodes in order
            procs[name] = subprocess.Popen(cmd, start_new_session=True, env=env)

        try:
            for role in ROLES:  # all nodes of a role start together (loading in parallel), prefill first
                mine = {n: v for n, v in nodes.items() if v[2].role == role}
                for name, (f, sets, cfg) in mine.items():
                    spawn(name, [sys.executable, "-m", "pdkv", "serve", "-c", str(f)]
                          + [a for o in sets + extra for a in ("--set", o)])
                for name, (f, sets, cfg) in mine.items():
                    _healthy(cfg, procs[name], timeout)
                    log.info("%s node up (pid %d): http://%s:%d", name, procs[name].pid, cfg.server.host,
                             cfg.server.port)
            decodes = [v[2] for v in nodes.values() if v[2].role == "decode"]
            ports = ", ".join(str(v[2].messenger.control_port) for v in nodes.values() if v[2].role == "prefill")
            d = decodes[0]
            if router_file.exists():
                from pdkv.config.router import load_router_config

                rcfg = load_router_config(router_file)
                spawn("router", [sys.executable, "-m", "pdkv", "router", "-c", str(router_file)])
                _router_ready(rcfg.host, rcfg.port, len(decodes), procs["router"], timeout)
                print(f"pdkv up: serving the OpenAI API at http://{rcfg.host}:{rcfg.port}/v1 (router in front of "
                      f"{len(decodes)} decode nodes: {', '.join(rcfg.nodes)}; prefill node(s) on control port(s) "
                      f"{ports}); Ctrl-C stops", flush=True)
            else:
                print(f"pdkv up: serving the OpenAI API at http://{d.server.host}:{d.server.port}/v1 "
                      f"(prefill node{'s' if ',' in ports else ''} on control port {ports}); Ctrl-C stops", flush=True)
            while stop["sig"] is None and all(p.poll() is None for p in procs.values()):
                time.sleep(0.2)
            dead = [r for r, p in procs.items() if p.poll() is not None]
            if dead and stop["sig"] is None:
                print(f"pdkv up: the {dead[0]} {'process' if dead[0] == 'router' else 'node'} exited with status "
                      f"{procs[dead[0]].returncode}; stopping", file=sys.stderr)
                return 1
            return 0
        except RuntimeError as e:
            print(f"pdkv up: {e}", file=sys.stderr)
            return 1
        finally:
            # the router first (no new requests), then decode nodes (they own the requests), then prefill
            groups = [["router"], [n for n, v in nodes.items() if v[2].role == "decode"],
                      [n for n, v in nodes.items() if v[2].role == "prefill"]]
            for group in groups:  # a group stops together (in parallel), the next after it
                running = [procs[n] for n in group if n in procs and procs[n].poll() is None]
                for p in running:
                    p.send_signal(signal.SIGTERM)
                for p in running:
                    try:
                        p.wait(30)
                    except subprocess.TimeoutExpired:
                        p.kill()
                        p.wait()
            if forks is not None:
                forks.close()
            for s, h in old.items():
                signal.signal(s, h)
