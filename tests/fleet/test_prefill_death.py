"""A prefill node killed mid-transfer while 8 greedy streams run through the router: the decode
node revokes the dead node's grants and sends those PREFILLs to the other prefill node itself
(disagg.prefill_retries), or with no other one computes those prompts here
(disagg.local_fallback), so no request fails and the router retries nothing; with
disagg.prefill_retries 0 it fails them with a 503 before their first token (nothing was
streamed) and the router sends them again. Either way every client stream completes with exactly
the tokens of an undisturbed run and every page comes back on every node."""
from __future__ import annotations

import asyncio
import json
import signal

import aiohttp
import pytest

from _cluster import make_engine, node_config, serve_node, wait_for
from _fleet import pages_back
from _procs import NodeProc, free_port, node_dict
from pdkv.config.router import load_router_config
from pdkv.router import RouterThread
from pdkv.server.app import NODE

GREEDY = {"temperature": 0, "max_tokens": 12, "ignore_eos": True, "stream": True}


async def _text(s: aiohttp.ClientSession, url: str, body: dict) -> tuple[int, str, list]:
    async with s.post(url + "/v1/completions", json=body) as r:
        if r.status != 200:
            return r.status, await r.text(), []
        text, events = [], []
        async for line in r.content:
            if line.startswith(b"data: "):
                d = line[6:].strip()
                events.append(d)
                if d != b"[DONE]":
                    msg = json.loads(d)
                    assert "error" not in msg, msg
                    text += [c["text"] for c in msg["choices"]]
        return r.status, "".join(text), events


def _counter(metrics: str, prefix: str) -> float:
    return sum(float(x.split()[-1]) for x in metrics.splitlines() if x.startswith(prefix))


@pytest.mark.slow  # node processes and a kill: ~20 s each
@pytest.mark.parametrize("retries,num_prefill", [(2, 2), (0, 2), (2, 1)],
                         ids=["decode-resends", "router-retries", "decode-prefills-here"])
def test_prefill_killed_mid_transfer_streams_complete_exactly(tiny_model_dir, tmp_path, retries, num_prefill):
    ports = [free_port() for _ in range(num_prefill)]
    pres = [NodeProc(tmp_path, f"p{i}", node_dict(tiny_model_dir, "prefill", port=free_port(), control_port=p))
            for i, p in enumerate(ports)]
    try:
        for p in pres:
            p.wait_healthy(180)
        dcfg = node_config(tiny_model_dir, "decode", messenger__prefill_peers=[f"127.0.0.1:{p}" for p in ports],
                           messenger__lease_s=30.0,  # the death is seen by the broken connection
                           disagg__prefill_retries=retries)
        eng = make_engine(dcfg)
        prompts = [[5 + i + j for j in range(30)] for i in range(8)]
        with serve_node(dcfg, eng) as dec:
            coord = dec.app[NODE].coordinator
            wait_for(lambda: len(coord.links.live()) == num_prefill, 20, "the prefill nodes connected")
            router = RouterThread(load_router_config(None, ["port=0", f"nodes=[{dec.url}]", "poll_interval_s=0.1"]))
            with router:
                async def run(victim=None):
                    async with aiohttp.ClientSession() as s:
                        tasks = [asyncio.create_task(_text(s, router.url, {"prompt": p, **GREEDY}))
                                 for p in prompts]
                        if victim is not None:
                            # PREFILLs sent to the frozen node: then it dies mid-transfer
                            await asyncio.to_thread(wait_for, lambda: any(
                                sl.peer.port == ports[0] for sl in list(coord.slots.values())), 20, "PREFILL to p0")
                            victim.signal(signal.SIGKILL)
                        return await asyncio.gather(*tasks)
                want = asyncio.run(run())
                assert all(st == 200 for st, _, _ in want), want
                pres[0].signal(signal.SIGSTOP)
                got = asyncio.run(run(pres[0]))
                metrics = __import__("urllib.request").request.urlopen(router.url + "/metrics").read().decode()
                dmetrics = __import__("urllib.request").request.urlopen(dec.url + "/metrics").read().decode()
            for (st, text, events), (_, want_text, _) in zip(got, want):
                assert st == 200 and events[-1] == b"[DONE]" and text == want_text, (st, text, want_text)
            retried = _counter(metrics, 'pdkv_router_retries_total{cause="unavailable"}')
            resent = _counter(dmetrics, "pdkv_disagg_prefill_retries_total{")
            failed = _counter(dmetrics, 'pdkv_kv_transfer_failures_total{')
            if retries:  # the decode node healed it: nothing failed, nothing reached the router
                assert resent >= 1 and retried == 0 and failed == 0, (resent, retried, failed)
                to = "remote" if num_prefill > 1 else "local"  # one prefill node: computed here
                assert resent == sum(float(x.split()[-1]) for x in dmetrics.splitlines() if x.startswith(
                    'pdkv_disagg_prefill_retries_total{cause="peer_dead"') and f'to="{to}"' in x), dmetrics
            else:
                assert retried >= 1 and resent == 0, [x for x in metrics.splitlines() if "retries" in x]
            wait_for(lambda: eng.allocator.num_free == eng.allocator.num_total, 10, "decode pool full")
            wait_for(lambda: not coord.memory.live and not coord.memory.held and not coord.slots, 10,
                     "every reservation released")
            assert len(coord.rows._free) == coord.rows.num_rows
            wait_for(lambda: all(pages_back(p) for p in pres[1:]), 10, "the surviving prefill node's pages back")
            print(f"prefill death: {int(resent)} PREFILL(s) sent again by the decode node, {int(retried)} "
                  "request(s) by the router, all 8 streams exact")
    finally:
        for p in pres:
            p.stop()
