"""A real etcd server (Debian's etcd-server package) on loopback ports with a temporary data dir."""
from __future__ import annotations

import os
import shutil
import subprocess
import time
import urllib.request
from pathlib import Path

from pdkv.ports import free_port

ETCD = shutil.which("etcd") or "/usr/bin/etcd"


class EtcdServer:
    def __init__(self, data_dir: Path):
        self.data_dir = data_dir
        self.port, self.peer_port = free_port(), free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None
        self.log = data_dir.parent / f"etcd-{self.port}.log"

    def start(self, timeout: float = 15.0) -> "EtcdServer":
        peer = f"http://127.0.0.1:{self.peer_port}"
        argv = [ETCD, "--name", "t", "--data-dir", str(self.data_dir), "--listen-client-urls", self.url,
                "--advertise-client-urls", self.url, "--listen-peer-urls", peer,
                "--initial-advertise-peer-urls", peer, "--initial-cluster", f"t={peer}",
                "--log-level", "error", "--logger", "zap"]
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                raise AssertionError(f"etcd exited with {self.proc.returncode}: {self.log.read_text()[-2000:]}")
            try:
                if b"true" in urllib.request.urlopen(self.url + "/health", timeout=1).read():
                    return self
            except OSError:
                pass
            time.sleep(0.05)
        raise AssertionError(f"etcd not healthy in {timeout} s: {self.log.read_text()[-2000:]}")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self.proc = None


def etcd_available() -> bool:
    return os.path.exists(ETCD)
