"""`pdkv up` with the seed's shape (decode.replicas: 3): one prefill node, three decode nodes on
free ports and a router in front; everything answers, and SIGTERM stops every process."""

from __future__ import annotations

import json
import re
import signal
import socket
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
import yaml

from pdkv.ports import free_port as _free_port

ROOT = Path(__file__).resolve().parents[2]




def _get(url: str):
    with urllib.request.urlopen(url, timeout=30) as r:
        return json.loads(r.read())


@pytest.mark.slow  # five `pdkv` processes: ~35 s
def test_up_with_three_decode_replicas_starts_them_and_a_router(router_model_dir, tmp_path):
    d = yaml.safe_load((ROOT / "configs" / "seed-shape.yaml").read_text())
    d["model"]["path"] = str(router_model_dir)
    d["kv_cache"] = {"num_pages": 64, "page_size": 16}
    d["router"]["policy"] = "round_robin"  # three requests: one on each node
    cluster = tmp_path / "cluster.yaml"
    cluster.write_text(yaml.safe_dump(d))
    api = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "pdkv", "up", "-c", str(cluster), "--set", f"server.port={api}",
                             "--log-level", "warning"], cwd=str(ROOT), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT)
    ports = []
    try:
        line = proc.stdout.readline().decode()
        while "serving the OpenAI API" not in line:
            assert line, "pdkv up exited before serving"
            line = proc.stdout.readline().decode()
        assert f":{api}/v1" in line and "router in front of 3 decode nodes" in line, line
        node_urls = re.findall(r"http://127\.0\.0\.1:\d+(?!/v1)\b", line.split("decode nodes:")[1])
        assert len(set(node_urls)) == 3, line
        ports = [int(u.rsplit(":", 1)[1]) for u in node_urls]
        health = _get(f"http://127.0.0.1:{api}/health")
        assert health["num_healthy"] == 3
        served = set()
        for i in range(3):
            body = json.dumps({"prompt": f"ciao numero {i}", "max_tokens": 3}).encode()
            req = urllib.request.Request(f"http://127.0.0.1:{api}/v1/completions", body,
                                         {"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=60) as r:
                assert json.loads(r.read())["usage"]["completion_tokens"] == 3
                served.add(r.headers["X-Pdkv-Node"])
        assert served == set(node_urls)  # every decode node answered (through the prefill node)
        for u in node_urls:
            h = _get(u + "/health")
            assert h["role"] == "decode"
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
    for port in [api, *ports]:  # every process is gone: its port is free again
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind(("127.0.0.1", port))
            s.listen()


def test_bad_replicas_is_a_config_error(router_model_dir, tmp_path):
    d = yaml.safe_load((ROOT / "configs" / "seed-shape.yaml").read_text())
    d["decode"]["replicas"] = 0
    cluster = tmp_path / "cluster.yaml"
    cluster.write_text(yaml.safe_dump(d))
    r = subprocess.run([sys.executable, "-m", "pdkv", "up", "-c", str(cluster)], cwd=str(ROOT),
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and f"{cluster}: decode.replicas must be an integer 1..16, got 0" in r.stderr, r.stderr
