"""``pdkv up``: a local disaggregated cluster (one prefill + one decode node) on loopback.

The cluster file holds the settings both nodes share at the top level (model, kv_cache,
scheduler, server, messenger) plus a ``prefill:`` and a ``decode:`` section whose keys override
the shared ones for that node. Each node is a ``pdkv serve`` subprocess with its own role config
(written into a temporary folder). ``--set`` applies to both nodes, except ``server.*``, which
is the decode node's API (the prefill node's ports come from its section); ``--set
prefill.server.port=8101`` / ``--set decode.X=Y`` set one node only.
The decode node's ``messenger.prefill_peers`` is filled in from the prefill node's control port.
Each cluster gets a fresh secret (pdkv/auth.py) in both nodes' environment, so the two
authenticate each other and nothing else on the host can pose as either.
"""

from __future__ import annotations

import copy
import logging
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from pdkv.auth import SECRET_ENV, new_secret
from pdkv.config import ConfigError, _read_yaml, load_config

log = logging.getLogger("pdkv.up")
ROLES = ("prefill", "decode")


def _merge(base: dict, over: dict) -> dict:
    out = copy.deepcopy(base)
    for k, v in (over or {}).items():
        out[k] = _merge(out.get(k) or {}, v) if isinstance(v, dict) else v
    return out


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def role_configs(path: str, overrides: list[str], workdir: Path) -> dict:
    """{role: (yaml path, overrides, Config)} for both nodes; ConfigError names the file,
    the node and the field."""
    import yaml

    data = _read_yaml(Path(path))
    sections = {r: data.pop(r, None) or {} for r in ROLES}
    for r, sec in sections.items():
        if not isinstance(sec, dict):
            raise ConfigError(f"{path}: {r} must be a mapping of sections to override for the {r} node")
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

    for role in ROLES:
        d = _merge(data, sections[role])
        d["role"] = role
        m = d.setdefault("messenger", {})
        if role == "prefill" and not m.get("control_port"):
            m["control_port"] = _free_port(m.get("control_host", "127.0.0.1"))
        if role == "decode":
            pm = out["prefill"][2].messenger
            m.setdefault("prefill_peers", [f"{pm.control_host}:{pm.control_port}"])
        f = workdir / f"{role}.yaml"
        f.write_text(yaml.safe_dump(d, sort_keys=False))
        sets = sets_for(role)
        try:
            cfg = load_config(f, sets)
        except ConfigError as e:
            raise ConfigError(str(e).replace(str(f), f"{path} ({role} node)")) from None
        out[role] = (f, sets, cfg)
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


def up(path: str, overrides: list[str], log_level: str | None = None, timeout: float = 300.0) -> int:
    """Start both nodes, wait until healthy, serve until SIGINT/SIGTERM or a node exits."""
    with tempfile.TemporaryDirectory(prefix="pdkv-up-") as tmp:
        roles = role_configs(path, list(overrides), Path(tmp))
        extra: list[str] = []
        if not roles["prefill"][2].model.path:  # build the embedded model once, not in both nodes at once
            from pdkv.default_model import ensure_default_model

            extra = [f"model.path={ensure_default_model()}"]
        stop = {"sig": None}

        def on_signal(sig, _frame):
            stop["sig"] = sig
        old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
        procs: dict[str, subprocess.Popen] = {}
        # One secret per cluster, handed to the nodes through their environment (never argv, which
        # `ps` shows); an operator's own $PDKV_CLUSTER_SECRET is kept.
        env = dict(os.environ)
        env.setdefault(SECRET_ENV, new_secret())
        try:
            for role in ROLES:
                f, sets, cfg = roles[role]
                cmd = [sys.executable, "-m", "pdkv", "serve", "-c", str(f)]
                cmd += [a for o in sets + extra for a in ("--set", o)]
                if log_level:
                    cmd += ["--log-level", log_level]
                # own process group: a terminal's Ctrl-C reaches `pdkv up`, which stops the nodes in order
                procs[role] = subprocess.Popen(cmd, start_new_session=True, env=env)
                _healthy(cfg, procs[role], timeout)
                log.info("%s node up (pid %d): http://%s:%d", role, procs[role].pid, cfg.server.host,
                         cfg.server.port)
            d = roles["decode"][2]
            print(f"pdkv up: serving the OpenAI API at http://{d.server.host}:{d.server.port}/v1 "
                  f"(prefill node on control port {roles['prefill'][2].messenger.control_port}); Ctrl-C stops",
                  flush=True)
            while stop["sig"] is None and all(p.poll() is None for p in procs.values()):
                time.sleep(0.2)
            dead = [r for r, p in procs.items() if p.poll() is not None]
            if dead and stop["sig"] is None:
                print(f"pdkv up: the {dead[0]} node exited with status {procs[dead[0]].returncode}; stopping",
                      file=sys.stderr)
                return 1
            return 0
        except RuntimeError as e:
            print(f"pdkv up: {e}", file=sys.stderr)
            return 1
        finally:
            for role in reversed(ROLES):  # decode first: it owns the requests
                p = procs.get(role)
                if p is not None and p.poll() is None:
                    p.send_signal(signal.SIGTERM)
                    try:
                        p.wait(30)
                    except subprocess.TimeoutExpired:
                        p.kill()
                        p.wait()
            for s, h in old.items():
                signal.signal(s, h)
