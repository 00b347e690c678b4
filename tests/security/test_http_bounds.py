"""The HTTP port's bounds (server/conn_limits.py, server.max_prompts_x_n): idle connections that
never send a byte are closed after server.idle_timeout_s, beyond server.max_connections the idle
ones go first, a request's prompts x n is capped with a 400 naming the limit — and the server
keeps serving its real clients throughout, with fds back at their level (from /proc)."""

import json
import socket
import time
import urllib.error
import urllib.request

import pytest
from _cluster import wait_for
from _hostile import closed_by_peer, proc_counts

from pdkv.config import load_config

BODY = {"prompt": "Hello", "max_tokens": 3, "temperature": 0}


@pytest.fixture(scope="module")
def served(tiny_model_dir):
    from pdkv.engine import LLMEngine
    from pdkv.server.runner import ServerThread

    cfg = load_config(None, [f"model.path={tiny_model_dir}", "server.port=0", "kv_cache.num_pages=64",
                             "kv_cache.page_size=4", "server.idle_timeout_s=1.5", "server.max_connections=50",
                             "server.max_prompts_x_n=8", "server.keepalive_timeout_s=60"])
    with ServerThread(cfg, LLMEngine.from_config(cfg)) as srv:
        yield srv


def post(url, body):
    req = urllib.request.Request(url + "/v1/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_idle_connections_are_closed_and_capped(served):
    before = proc_counts()
    socks = [socket.create_connection(("127.0.0.1", served.port), timeout=5) for _ in range(200)]
    status, body = post(served.url, BODY)  # served while 200 silent connections are open
    assert status == 200, body

    # beyond the cap (50) they go at once, the rest after the idle timeout
    wait_for(lambda: all(closed_by_peer(s) for s in socks), 15, "every idle connection closed by the server")
    for s in socks:
        s.close()
    wait_for(lambda: proc_counts()["fds"] <= before["fds"] + 3, 10, "fds back to their level")
    assert post(served.url, BODY)[0] == 200


def test_prompts_times_n_is_capped_with_a_400(served):
    status, body = post(served.url, {**BODY, "prompt": ["a", "b", "c"], "n": 3})
    assert status == 400 and "9 completions" in body["error"]["message"] \
        and "server.max_prompts_x_n" in body["error"]["message"], body
    status, body = post(served.url, {**BODY, "prompt": ["a", "b"], "n": 4})  # 8: at the limit
    assert status == 200 and len(body["choices"]) == 8, body
