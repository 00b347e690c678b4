"""The planner with the local actuator, end to end: real `pdkv serve` nodes and a `pdkv router` on
loopback, started and drained by `pdkv planner` (a subprocess) as the load steps.

Long prompts (prefilled by the prefill nodes) add a prefill node and no decode node; many short
streams (prefilled on the decode node: ``local_prefill_max_tokens``) add a decode node; idle, both
roles drain back to one after the cool-down, each drained node exiting 0; every request answered.
The capacities are given (small numbers, so a few requests are a load step here).
"""

import json
import os
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest
import yaml

from pdkv.ports import free_port

pytestmark = [pytest.mark.timeout(240), pytest.mark.slow]
ROOT = Path(__file__).resolve().parents[2]


def _get(url: str, timeout: float = 2.0):
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return json.loads(r.read())


def _complete(api: str, prompt: str, max_tokens: int, results: list) -> None:
    body = json.dumps({"model": "pdkv-stdlib-coder", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                       "ignore_eos": True}).encode()
    req = urllib.request.Request(api + "/v1/completions", body, {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            out = json.loads(r.read())
            results.append((r.status, out["usage"]["completion_tokens"]))
    except Exception as e:  # noqa: BLE001 - recorded: the test fails on it
        results.append((getattr(e, "code", None), repr(e)[:300]))


def _wait(pred, timeout: float, what: str, proc):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        assert proc.poll() is None, f"the planner exited with {proc.returncode} while waiting for {what}"
        try:
            v = pred()
            if v:
                return v
        except OSError:
            pass
        time.sleep(0.3)
    raise AssertionError(f"timed out waiting for {what}")


def test_local_actuator_scales_prefill_then_decode_up_and_drains_down(tmp_path):
    api_port, plan_port = free_port("127.0.0.1"), free_port("127.0.0.1")
    cluster = {
        "model": {"path": "", "dtype": "float32", "device": "cpu"},
        "kv_cache": {"page_size": 16, "memory_gib": 0.05, "layout": "HND"},
        "scheduler": {"max_num_batched_tokens": 1024, "chunk_size": 512, "max_num_seqs": 32},
        "server": {"host": "127.0.0.1", "port": api_port},
        "messenger": {"transport": "tcp", "heartbeat_s": 0.5, "lease_s": 5.0},
        "decode": {"disagg": {"local_prefill_max_tokens": 64}},
        "router": {"policy": "least_load", "poll_interval_s": 0.2},
    }
    (tmp_path / "cluster.yaml").write_text(yaml.safe_dump(cluster))
    planner = {
        "slo": {"ttft_ms": 5000, "itl_ms": 1000},
        "interval_s": 0.5,
        # given, not measured: one prefill node 200 prompt tokens/s, one decode node 6 streams
        "capacities": {"prefill": {"points": [{"tokens_per_s": 200, "ttft_ms": 100}]},
                       "decode": {"points": [{"streams": 6, "itl_ms": 10}]}},
        "nodes": {"prefill": "1..2", "decode": "1..2"},
        "policy": {"scale_down_cooldown_s": 3, "scale_down_stable_s": 3, "smoothing": 1.0},
        "server": {"host": "127.0.0.1", "port": plan_port},
        "actuator": {"kind": "local", "local": {"cluster": str(tmp_path / "cluster.yaml"),
                                                 "start_timeout_s": 120, "drain_timeout_s": 30}},
    }
    (tmp_path / "planner.yaml").write_text(yaml.safe_dump(planner))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-m", "pdkv", "planner", "-c", str(tmp_path / "planner.yaml"),
                             "--log-level", "warning"], env=env, start_new_session=True)
    plan_url, api = f"http://127.0.0.1:{plan_port}/plan", f"http://127.0.0.1:{api_port}"
    results: list = []
    try:
        _wait(lambda: _get(plan_url)["last"] is not None, 150, "the planner's first interval", proc)

        def running(role):
            return [n for n in _get(plan_url)["nodes"] if n["role"] == role and n["state"] in ("ready", "starting")]

        assert len(running("prefill")) == 1 and len(running("decode")) == 1
        # 1. a step of long prompts: ~600 prompt tokens each, 2 output tokens
        long_prompt = "def add(a, b):\n    return a + b\n" * 60
        threads = [threading.Thread(target=_complete, args=(api, long_prompt + f"# {i}\n", 2, results))
                   for i in range(4)]
        for t in threads:
            t.start()
        _wait(lambda: len(running("prefill")) == 2, 60, "a second prefill node", proc)
        assert len(running("decode")) == 1, "long prompts must not add a decode node"
        for t in threads:
            t.join(150)
        # 2. many short streams: prompts prefilled on the decode node, 160 tokens each -- long
        # enough that the planner sees them for several intervals (the default model decodes 40
        # tokens of 16 streams in well under one 0.5 s interval on a fast core)
        threads = [threading.Thread(target=_complete, args=(api, f"x = {i}\n", 160, results)) for i in range(16)]
        for t in threads:
            t.start()
        _wait(lambda: len(running("decode")) == 2, 60, "a second decode node", proc)
        for t in threads:
            t.join(150)
        # 3. idle: both roles drain back to one node, each drained node exiting 0
        _wait(lambda: len(running("prefill")) == 1 and len(running("decode")) == 1, 90, "the drain-down", proc)
        plan = _wait(lambda: (lambda p: p if all(n["state"] in ("ready", "gone") for n in p["nodes"]) else None)(
            _get(plan_url)), 60, "the drained nodes' exit", proc)
        gone = [n for n in plan["nodes"] if n["state"] == "gone"]
        assert sorted(n["role"] for n in gone) == ["decode", "prefill"], plan["nodes"]
        assert all(n["exit_code"] == 0 for n in gone), plan["nodes"]
        moves = [(r, c["desired"][r] - c["previous"][r]) for c in plan["changes"] for r in ("prefill", "decode")
                 if c["desired"][r] != c["previous"][r]]
        # +prefill, then +decode, and one step down each: nothing else (no flapping)
        assert moves[:2] == [("prefill", 1), ("decode", 1)], plan["changes"]
        assert sorted(moves[2:]) == [("decode", -1), ("prefill", -1)], \
            plan["changes"]
        metrics = urllib.request.urlopen(f"http://127.0.0.1:{plan_port}/metrics", timeout=2).read().decode()
        assert 'pdkv_planner_desired_nodes{role="prefill"} 1.0' in metrics
        assert 'pdkv_planner_decisions_total{direction="up",role="decode"} 1.0' in metrics
        if os.environ.get("PDKV_PLANNER_RECORD"):  # docs/FLEET.md's timeline of this run
            Path(os.environ["PDKV_PLANNER_RECORD"]).write_text(json.dumps(plan, indent=1))
        time.sleep(1.0)  # the router's poll notices the drained decode node is gone
        after: list = []
        _complete(api, long_prompt, 2, after)
        _complete(api, "y = 1\n", 8, after)
        results += after
        assert all(r[0] == 200 for r in results), results
        assert len(results) == 22 and [r[1] for r in results[-2:]] == [2, 8]
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
