"""Disaggregated DP2-EP groups over the loopback verbs device (both nodes `pdkv serve` children):
a TP1 prefill node, a TP2 prefill node (the latent whole on both ranks, the seed picking the rank
that sends), or a DP2-EP prefill group (each request computed on the rank its front
placed it on, its pages written from that rank's pool), writes each request's latent into the
one decode rank's pool the group placed it on (its ranges MRs of that rank's region alone);
tokens equal colocated."""

from __future__ import annotations

import json
import threading
import urllib.request
from pathlib import Path

import pytest
from _dp_disagg import PROMPTS, complete, reference  # noqa: F401

from _cluster import wait_for
from _procs import NodeProc, free_port, node_dict

from pdkv.bench.ab.launch import descendants

LONG = 150  # tokens of the request that keeps rank 0 busy


def _below(pid: int) -> list[str]:
    """The command lines of the processes below ``pid``, found by parent pid in /proc/*/stat
    (/proc/PID/task/*/children needs a kernel built with CONFIG_PROC_CHILDREN)."""
    out = []
    for p in descendants(pid)[1:]:
        try:
            out.append(Path(f"/proc/{p}/cmdline").read_bytes().replace(b"\0", b" ").decode())
        except OSError:
            continue  # gone meanwhile
    return out


def _load(url: str) -> dict:
    return json.loads(urllib.request.urlopen(url + "/load", timeout=10).read())


DP2 = {"dp": 2, "ep": True, "timeout_s": 30.0, "startup_timeout_s": 300.0}


@pytest.mark.parametrize("prefill", ["tp1", "tp2", "dp2"], ids=["tp1-prefill", "tp2-prefill", "dp2-prefill"])
def test_prefill_into_dp2_decode_over_verbs(moe_models, reference, tmp_path, loopback_verbs_dir, prefill):
    """Both nodes as `pdkv serve` children on the loopback verbs device: each request's ranges are
    MRs of its rank's pool (granted on that region alone); tokens equal colocated, and /load
    counts each rank's landed requests where the group placed them."""
    want_tokens, _ = reference
    folder, env, cport = moe_models["deepseek_v3"], {"LD_LIBRARY_PATH": loopback_verbs_dir}, free_port()
    p = node_dict(folder, "prefill", port=free_port(), control_port=cport, transport="verbs", nics=["lo_verbs0"])
    if prefill == "dp2":
        p["parallel"] = DP2
    elif prefill == "tp2":  # two rank processes, the latent whole on each: the seed picks the sender
        p["parallel"] = {"tp": 2, "timeout_s": 30.0}
    pre = NodeProc(tmp_path, "prefill", p, env)
    d = node_dict(folder, "decode", port=free_port(), peers=[f"127.0.0.1:{cport}"], transport="verbs",
                  nics=["lo_verbs0"])
    d["parallel"] = DP2
    dec = NodeProc(tmp_path, "decode", d, env)
    try:
        pre.wait_healthy(120)
        dec.wait_healthy(120)
        name = json.loads(urllib.request.urlopen(dec.url + "/v1/models").read())["data"][0]["id"]
        if prefill == "tp2":  # rank 1 is a process of its own, beside the server's rank 0
            assert sum("pdkv.tp.worker" in c for c in _below(pre.proc.pid)) == 1, _below(pre.proc.pid)
        # a long request keeps rank 0 busy (every tie goes to the lowest rank), so the two after
        # it are placed on rank 1 by load
        busy: dict = {}
        t = threading.Thread(target=lambda: busy.update(complete(dec.url, name, PROMPTS[0], LONG)))
        t.start()
        wait_for(lambda: _load(dec.url)["ranks"][0]["num_running"] == 1, 30, "the long request running on rank 0")
        got = [complete(dec.url, name, p) for p in PROMPTS[1:]]
        t.join(120)
        assert [g.get("choices", [{}])[0].get("token_ids") for g in got] == want_tokens[1:], got
        assert busy["choices"][0]["token_ids"][:len(want_tokens[0])] == want_tokens[0], busy  # greedy: a prefix
        assert len(busy["choices"][0]["token_ids"]) == LONG
        load = _load(dec.url)
        assert [r["num_remote_kv_landed"] for r in load["ranks"]] == [1, 2], load
    finally:
        dec.stop()
        pre.stop()
