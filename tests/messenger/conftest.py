"""Fixtures for the messenger tests: the transport parameter and child-process endpoints.

`transport` is "tcp" always, "verbs" when pdkv was built with libibverbs AND the loopback
verbs device (tests/verbs_loopback) builds here (verbs endpoints get LD_LIBRARY_PATH pointing
at that device, only in their own processes), and "libfabric:tcp;ofi_rxm" when libfabric's
provider is there (on the loopback interface); test_transfer.py adds sockets and shm
(`every_transport`).
"""
from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
from pathlib import Path

import msgpack
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from fabrics import FABRIC_DOMAINS, transport_params  # noqa: E402

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
LOOPBACK_NIC = "lo_verbs0"
RPC_TIMEOUT = 60.0  # a peer call that takes longer is a hang: the peer is killed, the test fails


class RemoteError(Exception):
    """An exception raised inside a peer process: .name is its class, .errno its code."""

    def __init__(self, name: str, msg: str, errno: int | None):
        super().__init__(f"{name}: {msg}")
        self.name, self.msg, self.errno = name, msg, errno


class Peer:
    """A child process running peer.Agent; attribute calls become RPCs."""

    def __init__(self, transport: str, node_id: int, env: dict, **kwargs):
        self.transport, self.node_id = transport, node_id
        self.proc = subprocess.Popen([sys.executable, str(HERE / "peer.py")], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, cwd=str(ROOT), env=env)
        self.unpacker = msgpack.Unpacker(raw=False, strict_map_key=False)
        if transport == "verbs":
            kwargs.setdefault("nics", [LOOPBACK_NIC])
        name = transport
        if transport.startswith("libfabric:"):
            name, provider = transport.split(":", 1)
            kwargs.setdefault("provider", provider)
            kwargs.setdefault("domains", FABRIC_DOMAINS.get(provider, []))
        self.rpc("create", name, node_id, kwargs)

    def rpc(self, op: str, *args, **kwargs):
        self.proc.stdin.write(msgpack.packb([op, list(args), kwargs], use_bin_type=True))
        self.proc.stdin.flush()
        res = next(self.unpacker, None)
        while res is None:
            if not select.select([self.proc.stdout], [], [], RPC_TIMEOUT)[0]:
                self.kill()
                raise RemoteError("Hang", f"peer {self.node_id}: no answer to {op}{args!r} in {RPC_TIMEOUT} s", None)
            data = os.read(self.proc.stdout.fileno(), 1 << 20)
            if not data:
                raise RemoteError("PeerDied", f"peer {self.node_id} exited (rc {self.proc.poll()})", None)
            self.unpacker.feed(data)
            res = next(self.unpacker, None)
        if "err" in res:
            raise RemoteError(res["err"], res["msg"], res["errno"])
        return res["ok"]

    def __getattr__(self, op: str):
        return lambda *a, **k: self.rpc(op, *a, **k)

    def m(self, method: str, *args, **kwargs):
        """Call a Messenger method in the peer."""
        return self.rpc("call", method, list(args), kwargs)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                self.rpc("close")
            except (RemoteError, BrokenPipeError):
                pass
            self.proc.stdin.close()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.kill()


def _connect(a: Peer, b: Peer) -> tuple[int, int]:
    """Two-phase connect both ways -> (conn of a to b, conn of b to a). auto: as processes of one
    host (what a HELLO's host identity tells a node), so its shm route is what runs."""
    hint = {"same_host": True} if a.transport == "auto" else {}
    ca, ia = a.m("prepare", b.node_id, **hint)
    cb, ib = b.m("prepare", a.node_id, **hint)
    a.m("complete", ca, ib)
    b.m("complete", cb, ia)
    return ca, cb


@pytest.fixture(params=transport_params())
def transport(request):
    return request.param


@pytest.fixture
def spawn(transport, request):
    """spawn(node_id, env_extra=None, **messenger_kwargs) -> Peer (env_extra: extra environment variables of
    that peer, e.g. PDKV_LOOPBACK_FAULTS); every peer is stopped after the test."""
    env = dict(os.environ)
    env.pop("LD_LIBRARY_PATH", None)
    if transport == "verbs":
        env["LD_LIBRARY_PATH"] = request.getfixturevalue("loopback_verbs_dir")
    peers: list[Peer] = []

    def make(node_id: int, env_extra: dict | None = None, **kwargs) -> Peer:
        p = Peer(transport, node_id, {**env, **(env_extra or {})}, **kwargs)
        peers.append(p)
        return p

    yield make
    for p in peers:
        p.stop()


@pytest.fixture
def connect():
    """connect(a, b) -> (conn of a to b, conn of b to a): the two-phase set-up both ways."""
    return _connect
