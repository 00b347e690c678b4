"""A prefill peer that keeps heartbeating but never answers CANCEL: the decode node fails the
client at once, keeps the request's pages quarantined for one lease (messenger.lease_s) after the
request ended, then revokes its grants and takes the pages back; the peer's later writes into
them are refused before a byte lands (real decode node, tcp, loopback)."""

import asyncio
import ctypes
import threading
import time

from _cluster import make_engine, node_config, post_completion, serve_node, wait_for

from pdkv._messenger import Messenger
from pdkv.transports import TcpOptions
from pdkv.auth import write_secret_file
from pdkv.control import ControlChannel
from pdkv.disagg import protocol as P
from pdkv.server.app import NODE


class SilentPrefill:
    """A prefill-node impostor with the right secret: connects, heartbeats, takes PREFILLs and
    answers nothing; ``write_late()`` then writes into the pages of the PREFILL it kept."""

    def __init__(self, hello, secret: bytes):
        self.hello = hello
        self.secret, self.m = secret, Messenger("tcp", 0x51E, TcpOptions(host="127.0.0.1"))
        self.src = bytearray(b"\xee" * (1 << 16))
        self.lkey = self.m.register(self.src)
        self.prefills: list[dict] = []
        self.cancels: list[dict] = []
        self.loop = asyncio.new_event_loop()
        ready = threading.Event()

        def run():
            asyncio.set_event_loop(self.loop)

            async def start():
                self.srv = await asyncio.start_server(self._accept, "127.0.0.1", 0)
                self.port = self.srv.sockets[0].getsockname()[1]
                ready.set()
            self.loop.run_until_complete(start())
            self.loop.run_forever()
        threading.Thread(target=run, daemon=True).start()
        ready.wait(10)

    async def _accept(self, reader, writer):
        ch = await ControlChannel.accept(reader, writer, self.hello, 5, secret=self.secret)
        msg = await ch.recv()
        self.conn, info = self.m.prepare(ch.peer.node_id, ch.token)
        await asyncio.get_running_loop().run_in_executor(None, self.m.complete, self.conn, msg["info"])
        await ch.send({"type": P.CONNECTED, "info": info})
        self.kv_key, self.page_nbytes = msg["kv_keys"][0], ch.peer.extra["page_nbytes"]
        ch.start_heartbeat(0.2, 3600.0, lambda reason: None)  # alive, as far as the lease can tell
        while True:
            m = await ch.recv()
            (self.prefills if m["type"] == P.PREFILL else self.cancels).append(m)

    def write_late(self, page: int) -> None:
        n = min(self.page_nbytes, len(self.src))
        self.m.write(self.conn, self.lkey, 0, self.kv_key, page * self.page_nbytes, n, imm=self.prefills[0]["imm"])

    def close(self):
        async def cancel_all():  # its heartbeat and reader tasks end with the loop, not after it
            for t in asyncio.all_tasks():
                if t is not asyncio.current_task():
                    t.cancel()
        asyncio.run_coroutine_threadsafe(cancel_all(), self.loop).result(5)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.m.close()


def test_grants_of_an_unanswered_cancel_are_revoked_one_lease_after_the_request_ended(tiny_model_dir, tmp_path):
    f = tmp_path / "cluster.secret"
    write_secret_file(f)
    sec = {"messenger__secret_file": str(f)}
    hello = P.make_hello(make_engine(node_config(tiny_model_dir, "prefill")), 0x51E, "prefill", "tcp")
    silent = SilentPrefill(hello, f.read_text().strip().encode())
    lease = 1.5
    dcfg = node_config(tiny_model_dir, "decode", messenger__prefill_peers=[f"127.0.0.1:{silent.port}"],
                       messenger__transfer_timeout_s=0.5, messenger__lease_s=lease, **sec)
    eng = make_engine(dcfg)
    d = serve_node(dcfg, eng).start()
    try:
        coord, a = d.app[NODE].coordinator, eng.allocator
        status, body = post_completion(d.url, {"model": hello.extra["model_name"], "prompt": list(range(5, 30)),
                                               "max_tokens": 2})
        ended = time.monotonic()
        assert status == 500 and "timed out after 0.5 s" in body["error"]["message"], body
        wait_for(lambda: silent.cancels, 5, "the CANCEL to reach the silent peer")
        assert a.num_free < a.num_total and any(s.grants for s in coord.slots.values())  # quarantined
        wait_for(lambda: a.num_free == a.num_total, lease + 5, "the pages back after one lease")
        assert time.monotonic() - ended >= lease - 0.6  # not before the lease (less the transfer timeout)
        assert not coord.slots and not coord.held
        page = silent.prefills[0]["pages"][0]
        region = coord.kv.regions[0]
        before = ctypes.string_at(region.address + page * silent.page_nbytes, silent.page_nbytes)
        refused = coord.m.stats()["refused_writes"]
        silent.write_late(page)
        wait_for(lambda: coord.m.stats()["refused_writes"] > refused, 5, "the late write refused")
        assert ctypes.string_at(region.address + page * silent.page_nbytes, silent.page_nbytes) == before
    finally:
        d.stop()
        silent.close()
