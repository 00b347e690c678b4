"""An authenticated but hostile prefill peer of a real decode node on the loopback verbs device
(every node a child process; the device checks rkey, protection domain and MR bounds as a NIC
does). The decode node registers each request's ranges as MRs in the writer's protection domain
and deregisters them when the request ends (pdkv/disagg/grants.py), so:

- a write outside the request's ranges, after they were revoked, or under a region key the
  peer was never granted gets a remote access error and lands nothing; the real prefill node's
  requests keep their outputs, no page or grant is leaked, the decode node keeps serving. The
  same attacks on tcp (every node on tcp: the receiver checks each frame against the writer's
  granted ranges) are refused the same way;
- a peer that holds its grants (never writes, never answers) holds at most
  messenger.max_grants_per_peer of them: the decode node sends it nothing more, and when no peer
  has room the client gets 503 naming the limit.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from _cluster import make_engine, node_config, post_completion, wait_for
from _procs import NodeProc, free_port, node_dict

from pdkv.auth import write_secret_file
from pdkv.engine import SamplingParams

HERE = Path(__file__).resolve().parent
MAX_TOKENS = 6
LEASE_S = 1.5  # messenger.lease_s of _procs.node_dict
PROMPTS = [list(range(5 + i, 5 + i + 3 + (i * 7) % 20)) for i in range(40)]  # distinct: no prefix hits


@pytest.fixture(scope="module")
def want(tiny_model_dir):
    eng = make_engine(node_config(tiny_model_dir, "colocated"))
    outs = eng.generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True))
    return [o.output_token_ids for o in outs]


class Impostor:
    def __init__(self, model_dir, secret_file: Path, mode: str, tmp: Path, env: dict, transport: str = "verbs"):
        self.out = tmp / f"impostor-{mode}.json"
        self.log = open(tmp / f"impostor-{mode}.log", "wb")
        self.port = free_port()  # chosen here so that the decode node can start meanwhile
        self.proc = subprocess.Popen([sys.executable, str(HERE / "_verbs_impostor.py"), str(model_dir),
                                      str(secret_file), mode, str(self.out), str(self.port), transport],
                                     stdout=self.log, stderr=subprocess.STDOUT, env={**os.environ, **env})

    def record(self) -> dict:
        assert self.proc.poll() is None, self.log.name
        return json.loads(self.out.read_text())

    def stop(self):
        self.proc.kill()
        self.proc.wait(10)
        self.log.close()


@pytest.fixture
def nodes(tiny_model_dir, tmp_path, request):
    """start(mode, transport="verbs", **decode messenger overrides) -> (real prefill, impostor,
    decode), every node on ``transport``."""
    secret = tmp_path / "cluster.secret"
    write_secret_file(secret)
    running = []

    def proc(name, role, env, transport, messenger=None, **kw):
        nics = ["lo_verbs0"] if transport == "verbs" else None
        d = node_dict(tiny_model_dir, role, port=free_port(), transport=transport, nics=nics, **kw)
        d["messenger"].update({"secret_file": str(secret), **(messenger or {})})
        running.append(NodeProc(tmp_path, name, d, env))
        return running[-1]

    def start(mode, transport="verbs", **decode_messenger):
        env = {"LD_LIBRARY_PATH": request.getfixturevalue("loopback_verbs_dir")} if transport == "verbs" else {}
        cport = free_port()
        pre = proc("prefill", "prefill", env, transport, control_port=cport)
        imp = Impostor(tiny_model_dir, secret, mode, tmp_path, env, transport)
        running.append(imp)
        dec = proc("decode", "decode", env, transport, decode_messenger,
                   peers=[f"127.0.0.1:{cport}", f"127.0.0.1:{imp.port}"])
        pre.wait_healthy()
        dec.wait_healthy()
        wait_for(lambda: all(p["connected"] for p in dec.health()["prefill_peers"]), 30, "both peers connected")
        return pre, imp, dec

    yield start
    for p in reversed(running):
        p.stop()


def _names(url: str) -> str:
    import urllib.request

    return json.loads(urllib.request.urlopen(url + "/v1/models").read())["data"][0]["id"]


def _run(url: str, ids: list[int]) -> list[tuple[int, int, dict]]:
    """Requests ``ids`` at once -> (id, status, body) each."""
    name = _names(url)
    got = []

    def one(i):
        s, b = post_completion(url, {"model": name, "prompt": PROMPTS[i], "max_tokens": MAX_TOKENS,
                                     "temperature": 0, "ignore_eos": True, "return_token_ids": True}, timeout=60)
        got.append((i, s, b))
    threads = [threading.Thread(target=one, args=(i,)) for i in ids]
    for t in threads:
        t.start()
    for t in threads:
        t.join(90)
    return got


def _pools_back(pre, dec):
    wait_for(lambda: dec.health()["num_pages_free"] == dec.health()["num_pages_total"], 15, "decode pages back")
    wait_for(lambda: dec.health()["grants_held"] == 0, 15, "every grant revoked (no MR left)")
    wait_for(lambda: pre.health()["num_pages_free"] == pre.health()["num_pages_total"], 15, "prefill pages back")


@pytest.mark.slow  # node processes and an impostor: ~45 s each
@pytest.mark.parametrize("transport", ["verbs", "tcp"])
def test_writes_outside_granted_ranges_get_remote_access_errors(nodes, want, transport):
    """The same attacks on both transports: verbs' NIC (the loopback device) and tcp's receiver
    must refuse the page right after a granted range, a write after the revoke and one under
    the region's key alike."""
    pre, imp, dec = nodes("attack", transport)
    served, failed, attacks, num_failed = 0, [], 0, 0
    end, i = time.monotonic() + 90, 0
    while len(imp.record()["attacks"]) < 3 and time.monotonic() < end and i + 2 <= len(PROMPTS):
        for rid, status, body in _run(dec.url, [i, i + 1]):  # two at once: real traffic during the attacks
            if status == 200:
                assert body["choices"][0]["token_ids"] == want[rid], (rid, body)  # nothing landed in its pages
                served += 1
            else:
                failed.append((rid, status, body))
        i += 2
        wait_for(lambda: all(p["connected"] for p in dec.health()["prefill_peers"]), 20, "impostor redialled")
        if len(imp.record()["attacks"]) > attacks or len(failed) > num_failed:
            # the chooser tries a peer that just failed a request last for one lease
            # (pdkv/disagg/choice.py): let that pass, or the real node gets every request
            attacks, num_failed = len(imp.record()["attacks"]), len(failed)
            time.sleep(LEASE_S + 0.3)
    rec = imp.record()
    assert [a["kind"] for a in rec["attacks"]] == ["foreign", "stale", "region"], rec
    assert all(a["refused"] is True for a in rec["attacks"]), rec  # the NIC / receiver refused each
    assert len(failed) <= rec["prefills"] and served >= i - rec["prefills"], (served, failed, rec)
    h = dec.health()
    assert h["refused_writes"] >= 3, h  # the decode side saw each access error
    _pools_back(pre, dec)
    # the decode node keeps serving through the real prefill node with unchanged outputs (the
    # impostor gone: the chooser would otherwise hand it this one again once its penalty lapsed)
    imp.stop()
    wait_for(lambda: sum(p["connected"] for p in dec.health()["prefill_peers"]) == 1, 20, "impostor seen gone")
    for rid, status, body in _run(dec.url, [len(PROMPTS) - 1]):
        assert status == 200 and body["choices"][0]["token_ids"] == want[rid], body


@pytest.mark.slow  # node processes and an impostor: ~45 s
def test_a_peer_that_holds_its_grants_is_bounded(nodes, want):
    # tiny model: 2 layers, one KV rank; a short prompt's pages are one run -> 1 + 2 grants (MRs)
    pre, imp, dec = nodes("silent", max_grants_per_peer=3, transfer_timeout_s=3.0)
    results = []
    for i in range(4):  # one at a time: round robin hands the silent peer the second one only
        results += _run(dec.url, [i])
    rec = imp.record()
    assert rec["prefills"] == 1, rec  # once it held 3 grants nothing more was sent to it
    held = {p["address"].rsplit(":", 1)[1]: p["grants"] for p in dec.health()["prefill_peers"]}
    assert held[str(imp.port)] == 3, held  # it never answered the CANCEL: its grants stay (bounded)
    ok = [(i, b) for i, s, b in results if s == 200]
    assert len(ok) == 3 and all(b["choices"][0]["token_ids"] == want[i] for i, b in ok), results
    # both peers full: the real one holds one in-flight request's grants at a time -> 503 naming the limit
    burst = _run(dec.url, list(range(10, 16)))
    refused = [b for _, s, b in burst if s == 503]
    assert all(s in (200, 503) for _, s, _ in burst), burst
    assert refused and all("messenger.max_grants_per_peer" in json.dumps(b) for b in refused), burst
    assert all(b["choices"][0]["token_ids"] == want[i] for i, s, b in burst if s == 200), burst
    imp.stop()  # the peer dies: its data path is torn down, its grants are revoked, its pages come back
    _pools_back(pre, dec)
    s, b = _run(dec.url, [20])[0][1:]
    assert s == 200 and b["choices"][0]["token_ids"] == want[20], b
