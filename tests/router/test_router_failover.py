"""A node dies mid-run: only its in-flight streams fail (an SSE error event naming it), it is out
within a second, new requests go elsewhere, and a node that comes back on its address is taken
back. The node that dies is a real ``pdkv serve`` process, killed with SIGKILL."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import aiohttp

from pdkv.router import RouterThread
from pdkv.ports import free_port as _free_port

ROOT = Path(__file__).resolve().parents[2]
LONG = {"temperature": 0, "max_tokens": 480, "ignore_eos": True, "stream": True}




def _start_node_process(model_dir: Path, port: int, log_path: Path) -> subprocess.Popen:
    with open(log_path, "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "pdkv", "serve", "--set", f"model.path={model_dir}",
                                 "--set", f"server.port={port}", "--set", "kv_cache.num_pages=256"],
                                cwd=ROOT, env=dict(os.environ, PYTHONUNBUFFERED="1"), stdout=log,
                                stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 120
    while True:
        assert proc.poll() is None, log_path.read_text()
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2):
                return proc
        except OSError:
            assert time.monotonic() < deadline, log_path.read_text()
            time.sleep(0.2)


def _node_health(router_url: str) -> dict:
    import json

    with urllib.request.urlopen(router_url + "/nodes", timeout=5) as r:
        return {n["url"]: n["health"] for n in json.loads(r.read())}


def test_a_killed_node_fails_only_its_streams_and_is_taken_out_then_back(rt, nodes, router_model_dir, tmp_path):
    port = _free_port()
    victim_url = f"http://127.0.0.1:{port}"
    proc = _start_node_process(router_model_dir, port, tmp_path / "victim.log")
    urls = [nodes[0].url, nodes[1].url, victim_url]
    back = None
    try:
        # migration off: the old behaviour (an SSE error naming the node); tests/router/test_migration.py
        with RouterThread(rt.router_cfg(urls, "policy=least_load", "migration_limit=0")) as router, \
                RouterThread(rt.router_cfg([victim_url])) as only_victim:
            async def run_and_kill():
                async with aiohttp.ClientSession() as s:
                    first_from_victim = asyncio.Event()

                    async def whole():  # not streamed: nothing sent on yet when the node dies
                        async with s.post(only_victim.url + "/v1/completions",
                                          json={"prompt": "un racconto intero", **LONG, "stream": False}) as r:
                            return r.status, await r.json()
                    whole_task = asyncio.create_task(whole())

                    async def one(i: int):
                        async with s.post(router.url + "/v1/completions",
                                          json={"prompt": f"racconto numero {i}", **LONG}) as r:
                            node, events = r.headers["X-Pdkv-Node"], []
                            async for line in r.content:
                                if line.startswith(b"data: "):
                                    events.append(line[6:].strip())
                                    if node == victim_url:
                                        first_from_victim.set()
                            return node, events
                    tasks = [asyncio.create_task(one(i)) for i in range(6)]
                    await asyncio.wait_for(first_from_victim.wait(), 30)
                    proc.send_signal(signal.SIGKILL)
                    killed = time.monotonic()
                    while True:  # how soon the router takes it out (while the other streams run on)
                        async with s.get(router.url + "/nodes") as r:
                            if {n["url"]: n["health"] for n in await r.json()}[victim_url] == "down":
                                break
                        await asyncio.sleep(0.02)
                    out_after = time.monotonic() - killed
                    return await asyncio.gather(*tasks), out_after, await whole_task
            results, out_after, (whole_status, whole_body) = rt.run(run_and_kill())
            # the request that was waiting for its whole answer: a 502 naming the node
            assert whole_status == 502 and whole_body["error"]["code"] == "node_failed", whole_body
            assert victim_url in whole_body["error"]["message"]
            on_victim = [ev for node, ev in results if node == victim_url]
            others = [ev for node, ev in results if node != victim_url]
            assert on_victim and others
            for ev in on_victim:  # failed clearly: an error event naming the node, no [DONE]
                assert b"[DONE]" not in ev and b"node_failed" in ev[-1] and victim_url.encode() in ev[-1], ev[-1]
            for ev in others:  # untouched by the death of another node
                assert ev[-1] == b"[DONE]" and b"error" not in b"".join(ev)
            assert out_after < 1.0, f"the dead node was out only after {out_after:.2f} s"

            # new requests go elsewhere, all succeed
            async def more():
                async with aiohttp.ClientSession() as s:
                    return await asyncio.gather(*(rt.post(s, router.url, {"prompt": f"dopo {i}", "max_tokens": 8})
                                                  for i in range(6)))
            for status, node, body in rt.run(more()):
                assert status == 200 and node != victim_url and body["choices"][0]["text"] is not None

            # a node answering on the dead one's address again is taken back
            back = rt.Node(router_model_dir, port=port)
            t0 = time.monotonic()
            while _node_health(router.url)[victim_url] != "up":
                assert time.monotonic() - t0 < 5, "the node did not come back"
                time.sleep(0.02)

            async def spread():
                async with aiohttp.ClientSession() as s:
                    return await asyncio.gather(*(rt.post(s, router.url, {"prompt": f"ritorno {i}",
                                                                          "max_tokens": 8}) for i in range(9)))
            assert victim_url in {node for _, node, _ in rt.run(spread())}
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        if back is not None:
            back.stop()
