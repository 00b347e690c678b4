"""Nodes as child processes (``python -m pdkv serve``), for tests that kill them or that need
the loopback verbs device (LD_LIBRARY_PATH only in the children)."""
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

from pdkv.ports import free_port  # noqa: F401  (re-exported for the tests)

ROOT = Path(__file__).resolve().parents[2]


class NodeProc:
    def __init__(self, tmp: Path, name: str, cfg: dict, env_extra: dict | None = None, script=None):
        """``script``: (path, *args) of a test-side script run with the config's path first,
        instead of ``pdkv serve``."""
        self.port = cfg["server"]["port"]
        self.url = f"http://127.0.0.1:{self.port}"
        path = tmp / f"{name}.yaml"
        path.write_text(yaml.safe_dump(cfg))
        env = dict(os.environ)
        env.pop("LD_LIBRARY_PATH", None)
        env.update(env_extra or {})
        self.log = open(tmp / f"{name}.log", "wb")
        argv = ([sys.executable, "-m", "pdkv", "serve", "-c", str(path), "--log-level", "warning"] if script is None
                else [sys.executable, str(script[0]), str(path), *map(str, script[1:])])
        self.proc = subprocess.Popen(argv, cwd=str(ROOT), env=env, stdout=self.log, stderr=subprocess.STDOUT)
        self.log_path = tmp / f"{name}.log"

    def wait_healthy(self, timeout: float = 180.0) -> dict:
        """The node's /health once it answers. ``timeout`` only guards against a node that never
        comes up: a start (import torch, load the model) takes seconds alone but can take a
        minute on a 2-core machine running the suite's other worker and other jobs."""
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                raise AssertionError(f"node exited with {self.proc.returncode}: {self.log_path.read_text()[-2000:]}")
            try:
                return json.loads(urllib.request.urlopen(self.url + "/health", timeout=2).read())
            except OSError:
                time.sleep(0.1)
        raise AssertionError(f"node not healthy in {timeout} s: {self.log_path.read_text()[-2000:]}")

    def health(self) -> dict:
        return json.loads(urllib.request.urlopen(self.url + "/health", timeout=5).read())

    def signal(self, sig) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self.log.close()


def node_dict(model_dir, role: str, *, port: int, control_port: int = 0, peers=(), transport: str = "tcp",
              nics=None, page_size: int = 4, num_pages: int = 64, chunk: int = 16) -> dict:
    m = {"transport": transport, "heartbeat_s": 0.2, "lease_s": 1.5, "transfer_timeout_s": 20.0,
         "connect_timeout_s": 20.0, "control_port": control_port, "prefill_peers": list(peers)}
    if nics:
        m["nics"] = list(nics)
    d = {"role": role, "model": {"path": str(model_dir)},
         "kv_cache": {"page_size": page_size, "num_pages": num_pages},
         "scheduler": {"max_num_batched_tokens": 64, "chunk_size": chunk, "max_num_seqs": 8},
         "server": {"port": port}, "messenger": m}
    if role == "decode":  # the transfer is what these tests exercise: no local prefill of short prompts
        d["disagg"] = {"local_prefill_max_tokens": 0}
    return d
