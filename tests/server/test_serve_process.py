"""``python -m pdkv serve -c configs/colocated.yaml`` as a real process: it serves the shipped
default model, logs where it listens, answers a streamed request, and stops cleanly on SIGINT."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from pdkv.ports import free_port

ROOT = Path(__file__).resolve().parents[2]




def test_serve_default_config_end_to_end(tmp_path):
    port = free_port()
    env = dict(os.environ, PDKV_CACHE_DIR=str(tmp_path / "cache"), PYTHONUNBUFFERED="1")
    log_path = tmp_path / "server.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "pdkv", "serve", "-c", "configs/colocated.yaml",
                                 "--set", f"server.port={port}", "--set", "kv_cache.memory_gib=0.05"],
                                cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 180
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
        body = json.dumps({"prompt": "Hello", "max_tokens": 5, "temperature": 0, "ignore_eos": True,
                           "stream": True}).encode()
        req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", body,
                                     {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=60) as r:
            lines = [ln.strip() for ln in r if ln.strip()]
        assert lines[-1] == b"data: [DONE]"
        chunks = [json.loads(ln[6:]) for ln in lines[:-1]]
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"
        assert chunks[0]["model"] == "pdkv-stdlib-coder"
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            rc = proc.wait(60)
        except subprocess.TimeoutExpired:  # never leave a server behind, even when the test fails
            proc.kill()
            proc.wait()
            raise
    out = log_path.read_text()
    assert rc == 0, out
    assert f"listening on http://127.0.0.1:{port}" in out
    assert "loading weights: 100%" in out  # the progress bar while the model loads
    assert not (tmp_path / "cache" / "models").exists()  # shipped, not built
