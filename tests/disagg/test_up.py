"""`pdkv up`: a cluster file becomes two `pdkv serve` nodes; the API answers through both; SIGTERM
stops both. Config errors name the file, the node and the field."""
from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
import urllib.request

import yaml

from _procs import ROOT, free_port


def _cluster_file(tmp_path, model_dir, **decode):
    d = yaml.safe_load((ROOT / "configs" / "local-disagg.yaml").read_text())
    d["model"]["path"] = str(model_dir)
    d["kv_cache"].update(num_pages=64, page_size=4)
    d["decode"] = {"disagg": {"local_prefill_max_tokens": 0}, **decode}  # a short prompt still goes remote
    p = tmp_path / "cluster.yaml"
    p.write_text(yaml.safe_dump(d))
    return p


def test_up_serves_through_both_nodes_and_stops_both(tiny_model_dir, tmp_path):
    path = _cluster_file(tmp_path, tiny_model_dir)
    api, pport, cport = free_port(), free_port(), free_port()
    proc = subprocess.Popen([sys.executable, "-m", "pdkv", "up", "-c", str(path), "--set", f"server.port={api}",
                             "--set", f"prefill.server.port={pport}", "--set",
                             f"prefill.messenger.control_port={cport}", "--log-level", "warning"],
                            cwd=str(ROOT), stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        line = proc.stdout.readline().decode()
        while "serving the OpenAI API" not in line:
            assert line, "pdkv up exited before serving"
            line = proc.stdout.readline().decode()
        assert f":{api}/v1" in line and f"control port {cport}" in line
        body = json.dumps({"prompt": "hello there", "max_tokens": 3}).encode()
        req = urllib.request.Request(f"http://127.0.0.1:{api}/v1/completions", body,
                                     {"Content-Type": "application/json"})
        out = json.loads(urllib.request.urlopen(req, timeout=30).read())
        assert out["usage"]["completion_tokens"] == 3
        pre = json.loads(urllib.request.urlopen(f"http://127.0.0.1:{pport}/health").read())
        assert pre["role"] == "prefill" and pre["decode_nodes"] == 1
        metrics = urllib.request.urlopen(f"http://127.0.0.1:{pport}/metrics").read().decode()
        sent = [x for x in metrics.splitlines() if x.startswith("pdkv_kv_transfer_bytes_total")]
        assert sent and float(sent[0].split()[-1]) > 0, sent
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(40) == 0
    time.sleep(0.2)
    for port in (api, pport, cport):  # both nodes are gone: their ports are free again
        import socket

        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # TIME_WAIT is fine, a listener is not
            s.bind(("127.0.0.1", port))
            s.listen()


def test_up_config_error_names_file_node_and_field(tiny_model_dir, tmp_path):
    path = _cluster_file(tmp_path, tiny_model_dir, kv_cache={"layout": "HDN"})
    r = subprocess.run([sys.executable, "-m", "pdkv", "up", "-c", str(path)], cwd=str(ROOT),
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2
    assert f"{path} (decode node): kv_cache.layout must be one of HND, NHD, got 'HDN'" in r.stderr, r.stderr


def test_up_puts_roles_on_shared_weights_and_shm_unless_the_file_says(tiny_model_dir, tmp_path):
    """Every node of `pdkv up` runs on this host: the auto transport (shm between them, found by
    the HELLOs' host identity) and one copy of the weights by default; the cluster file (or
    --set) still chooses."""
    from pdkv.disagg.launcher import role_configs

    nodes = role_configs(str(_cluster_file(tmp_path, tiny_model_dir)), [], tmp_path)
    assert {(c.messenger.transport, c.model.share_weights) for _, _, c in nodes.values()} == {("auto", "auto")}
    nodes = role_configs(str(_cluster_file(tmp_path, tiny_model_dir)),
                         ["messenger.transport=tcp", "model.share_weights=off"], tmp_path)
    assert {(c.messenger.transport, c.model.share_weights) for _, _, c in nodes.values()} == {("tcp", "off")}
