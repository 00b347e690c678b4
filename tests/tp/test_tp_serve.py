"""``pdkv serve -c configs/tp2.yaml`` as a real process: rank 0 serves HTTP and starts rank 1;
a greedy completion equals the one-process engine's, and SIGINT stops both processes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from pdkv.engine import SamplingParams
from pdkv.ports import free_port as _free_port

ROOT = Path(__file__).resolve().parents[2]




def _children(pid: int) -> list[int]:
    out = []
    for d in Path("/proc").iterdir():
        try:
            if d.name.isdigit() and int((d / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid \
                    and b"pdkv.tp.worker" in (d / "cmdline").read_bytes():
                out.append(int(d.name))
        except (OSError, IndexError, ValueError):
            pass
    return out


def _gone(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return True
    return state == "Z"


@pytest.mark.slow  # a TP2 `pdkv serve` process and its follower: ~40 s
def test_serve_tp2_over_http(tp, llama_pair, tmp_path):
    one, _ = llama_pair
    model_dir = tp.model_dir("llama", 2)
    port = _free_port()
    log_path = tmp_path / "server.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "pdkv", "serve", "-c", "configs/tp2.yaml",
                                 "--set", f"model.path={model_dir}", "--set", f"server.port={port}",
                                 "--set", "kv_cache.num_pages=64"],
                                cwd=ROOT, env=dict(os.environ, PYTHONUNBUFFERED="1"), stdout=log,
                                stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, log_path.read_text()
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            assert time.monotonic() < deadline, log_path.read_text()
            time.sleep(0.2)
        followers = _children(proc.pid)
        assert len(followers) == 1, log_path.read_text()
        body = json.dumps({"model": model_dir.name, "prompt": tp.PROMPTS[0], "max_tokens": 8,
                           "temperature": 0, "ignore_eos": True}).encode()
        req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", body,
                                     {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=60) as r:
            got = json.loads(r.read())["choices"][0]["text"]
        # a text prompt of /v1/completions is token-healed by default (server.token_healing: auto)
        want = one.generate([tp.PROMPTS[0]], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True,
                                                            token_healing=True))[0]
        assert got == want.text
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            rc = proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise
    assert rc == 0, log_path.read_text()
    deadline = time.monotonic() + 10
    while not all(_gone(p) for p in followers) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert all(_gone(p) for p in followers), "rank 1 outlived the server"
