"""A hostile decode node for the security tests: a real tcp messenger and a real control
channel, driven by hand so it can send what a real decode node never would."""
from __future__ import annotations

import asyncio
import dataclasses
import os
import socket

from pdkv._messenger import Messenger
from pdkv.transports import TcpOptions
from pdkv.control import ControlChannel
from pdkv.disagg import protocol as P


def closed_by_peer(s: socket.socket) -> bool:
    """Whether the node closed this (idle) connection: EOF or a reset; False while it is open."""
    s.settimeout(0.01)
    try:
        return s.recv(4096) == b""
    except (socket.timeout, BlockingIOError):
        return False
    except OSError:
        return True


def proc_counts() -> dict:
    """This process's open fds, threads and RSS (kB), from /proc."""
    status = open("/proc/self/status").read().split("\n")
    field = {ln.split(":")[0]: ln.split(":")[1].strip() for ln in status if ":" in ln}
    return {"fds": len(os.listdir("/proc/self/fd")), "threads": int(field["Threads"]),
            "rss_kb": int(field["VmRSS"].split()[0])}


class HostileDecode:
    """Connect to a prefill node as a decode node (authenticated with ``secret`` if given)."""

    def __init__(self, prefill_coordinator, node_id: int = 0x5EED):
        self.pc, self.node_id = prefill_coordinator, node_id
        kv = prefill_coordinator.kv
        self.buf = bytearray(kv.regions[0].nbytes)
        self.hidden = bytearray(1 << 16)
        self.m = Messenger("tcp", node_id, TcpOptions(host="127.0.0.1"))
        self.kv_key = self.m.register(self.buf)
        self.hidden_key = self.m.register(self.hidden)
        self.spec_key = None  # a speculative hand-off's proposer cache (its HELLO layout is the prefill node's)
        spec_kv = prefill_coordinator.hello.extra.get("spec_kv")
        if spec_kv is not None:
            self.spec_buf = bytearray(spec_kv["num_layers"] * spec_kv["layer_nbytes"])
            self.spec_key = self.m.register(self.spec_buf)
        self.ch: ControlChannel | None = None

    def hello(self):
        ph = self.pc.hello
        return dataclasses.replace(ph, node_id=self.node_id, role="decode")

    async def connect(self, port: int, secret: bytes | None, token=None, info=None) -> ControlChannel:
        """``info``: a data-path info to send instead of this messenger's (then CONNECT is sent and
        the channel returned without waiting for CONNECTED)."""
        ch = await ControlChannel.connect("127.0.0.1", port, self.hello(), 5, secret=secret)
        grant_to = ch.peer.node_id
        self.m.grant(self.kv_key, grant_to)
        self.m.grant(self.hidden_key, grant_to)
        spec = {}
        if self.spec_key is not None:
            self.m.grant(self.spec_key, grant_to)
            spec = {"spec_key": self.spec_key}
        conn, real = self.m.prepare(grant_to, ch.token if token is None else token)
        await ch.send({"type": P.CONNECT, "info": info or real, "kv_key": self.kv_key, "kv_keys": [self.kv_key],
                       "hidden_key": self.hidden_key, **spec})
        if info is not None:
            self.ch = ch
            return ch
        msg = await asyncio.wait_for(ch.recv(), 10)
        assert msg["type"] == P.CONNECTED, msg
        await asyncio.get_running_loop().run_in_executor(None, self.m.complete, conn, msg["info"])
        self.ch = ch
        return ch

    async def until(self, pred, timeout: float = 20.0) -> list[dict]:
        """Control messages until one satisfies ``pred`` (all of them returned)."""
        got = []
        async def run():
            while True:
                got.append(await self.ch.recv())
                if pred(got[-1]):
                    return got
        return await asyncio.wait_for(run(), timeout)

    def close(self):
        if self.ch is not None:
            self.ch.close()
        self.m.close()


def blackhole_info(info: bytes, port: int) -> bytes:
    """``info`` (a tcp prepare()'s) redirected to ``port`` (a listener that never accepts)."""
    from pdkv._messenger import tcp_decode_info
    import struct

    off = info.find(struct.pack("<H", tcp_decode_info(info)["port"]))
    return info[:off] + struct.pack("<H", port) + info[off + 2:]
