"""An authenticated but hostile prefill peer of a real decode node (tcp, loopback): it holds the
cluster secret, so it is connected, but it writes outside the pages of the request it was sent.
The decode node's narrow grants (pdkv/disagg/grants.py) refuse the write before a byte lands;
the real prefill node's requests keep their outputs and no page is leaked."""

import asyncio
import ctypes
import dataclasses
import threading

import pytest
from _cluster import (Cluster, make_engine, node_config, post_completion, serve_node, wait_for)
from _hostile import proc_counts

from pdkv._messenger import Messenger
from pdkv.transports import TcpOptions
from pdkv.auth import write_secret_file
from pdkv.control import ControlChannel
from pdkv.disagg import protocol as P
from pdkv.server.app import NODE

PROMPT = {"prompt": "Tutte le strade portano a Roma", "max_tokens": 8, "temperature": 0}


class HostilePrefill:
    """A prefill-node impostor with the right secret, on its own event loop thread."""

    def __init__(self, real_hello, secret: bytes):
        self.hello = dataclasses.replace(real_hello, node_id=0xBAD)
        self.secret, self.m = secret, Messenger("tcp", 0xBAD, TcpOptions(host="127.0.0.1"))
        self.src = bytearray(1 << 20)
        for i in range(len(self.src)):
            self.src[i] = 0xAB if i % 2 else 0xCD
        self.lkey = self.m.register(self.src)
        self.seen: list[dict] = []
        self.loop = asyncio.new_event_loop()
        self.ready = threading.Event()
        threading.Thread(target=self._run, daemon=True).start()
        self.ready.wait(10)

    def _run(self):
        asyncio.set_event_loop(self.loop)

        async def start():
            self.srv = await asyncio.start_server(self._accept, "127.0.0.1", 0)
            self.port = self.srv.sockets[0].getsockname()[1]
            self.ready.set()
        self.loop.run_until_complete(start())
        self.loop.run_forever()

    async def _accept(self, reader, writer):
        ch = await ControlChannel.accept(reader, writer, self.hello, 5, secret=self.secret)
        msg = await ch.recv()
        conn, info = self.m.prepare(ch.peer.node_id, ch.token)
        await asyncio.get_running_loop().run_in_executor(None, self.m.complete, conn, msg["info"])
        await ch.send({"type": P.CONNECTED, "info": info})
        geo = ch.peer.extra
        while True:
            m = await ch.recv()
            if m["type"] != P.PREFILL:
                continue
            self.seen.append(m)
            foreign = next(p for p in range(geo["num_pages"]) if p not in m["pages"])
            self.foreign = foreign
            # one write into a page of ANOTHER request (in bounds of the region: tcp's old checks pass)
            self.m.write(conn, self.lkey, 0, msg["kv_keys"][0], foreign * geo["page_nbytes"], geo["page_nbytes"],
                         imm=m["imm"])
            await asyncio.sleep(0.5)
            ch.close()  # then vanish: the decode node fails this one request
            return

    def close(self):
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.m.close()


@pytest.fixture(scope="module")
def cluster(tiny_model_dir, tmp_path_factory):
    f = tmp_path_factory.mktemp("secret") / "cluster.secret"
    write_secret_file(f)
    secret = f.read_text().strip().encode()
    c = Cluster(tiny_model_dir, prefill_over={"messenger__secret_file": str(f)},
                decode_over={"messenger__secret_file": str(f)})
    c.expected = post_completion(c.url, {**PROMPT, "model": c.model_name()})[1]["choices"][0]["text"]
    hostile = HostilePrefill(c.prefill.app[NODE].coordinator.hello, secret)
    # a second decode node whose peers are the real prefill node and the impostor
    real = c.prefill.app[NODE].control_port
    dcfg = node_config(tiny_model_dir, "decode", messenger__secret_file=str(f),
                       messenger__prefill_peers=[f"127.0.0.1:{real}", f"127.0.0.1:{hostile.port}"],
                       disagg__affinity_pages=0)  # the same prompt three times: both peers get it
    c.d2_engine = make_engine(dcfg)
    c.d2 = serve_node(dcfg, c.d2_engine).start()
    c.hostile = hostile
    yield c
    c.d2.stop()
    hostile.close()
    c.stop()


def test_write_outside_the_requests_pages_is_refused(cluster):
    d2 = cluster.d2.app[NODE].coordinator
    region = d2.kv.regions[0]
    page_nbytes = d2.kv.geometry.page_nbytes
    before = ctypes.string_at(region.address, region.nbytes)
    t0 = proc_counts()
    model = cluster.model_name()
    outcomes = [post_completion(cluster.d2.url, {**PROMPT, "model": model}) for _ in range(3)]
    assert cluster.hostile.seen, "the impostor got no request (ties rotate over both peers)"
    foreign = cluster.hostile.foreign
    # the foreign page was not touched by the impostor (0xCD/0xAB would be there otherwise)
    page = ctypes.string_at(region.address + foreign * page_nbytes, page_nbytes)
    assert page == before[foreign * page_nbytes:(foreign + 1) * page_nbytes] or b"\xcd\xab" * 8 not in page
    assert d2.m.stats()["refused_writes"] >= 1
    ok = [b for s, b in outcomes if s == 200]
    bad = [b for s, b in outcomes if s != 200]
    assert len(bad) <= 1 and all(b["choices"][0]["text"] == cluster.expected for b in ok), outcomes
    # the real peer keeps serving it with unchanged outputs, and every page comes back
    s, b = post_completion(cluster.d2.url, {**PROMPT, "model": model})
    assert s == 200 and b["choices"][0]["text"] == cluster.expected
    a = cluster.d2_engine.allocator
    wait_for(lambda: a.num_free == a.num_total, 10, "every decode page back")
    assert not any(s.grants for s in d2.slots.values())
    assert proc_counts()["threads"] <= t0["threads"] + 4
