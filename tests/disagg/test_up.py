"""`pdkv up`: a cluster file becomes two `pdkv serve` nodes; the API answers through both; SIGTERM
stops both. Config errors name the file, the node and the field."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request

import pytest
import yaml

from _procs import ROOT, free_port


def _cluster_file(tmp_path, model_dir, fork=None, **decode):
    d = yaml.safe_load((ROOT / "configs" / "local-disagg.yaml").read_text())
    d["model"]["path"] = str(model_dir)
    if fork is not None:
        d["fork"] = fork
    d["kv_cache"].update(num_pages=64, page_size=4)
    d["decode"] = {"disagg": {"local_prefill_max_tokens": 0}, **decode}  # a short prompt still goes remote
    p = tmp_path / "cluster.yaml"
    p.write_text(yaml.safe_dump(d))
    return p


def _children(pid: int) -> dict[int, str]:
    """{pid: command line} of the processes whose parent is ``pid``."""
    out = {}
    for d in os.listdir("/proc"):
        try:
            if d.isdigit() and int(open(f"/proc/{d}/stat").read().rsplit(")", 1)[1].split()[1]) == pid:
                out[int(d)] = open(f"/proc/{d}/cmdline").read().replace("\0", " ")
        except (OSError, IndexError, ValueError):
            continue
    return out


def _nodes_of(up_pid: int, fork: bool) -> list[int]:
    """The node processes of a `pdkv up`: forked by its fork server, or its own children."""
    kids = _children(up_pid)
    servers = [p for p, cmd in kids.items() if "pdkv.forkserver" in cmd]
    if not fork:
        assert not servers and len(kids) == 2 and all(" serve " in c for c in kids.values()), kids
        return list(kids)
    assert len(servers) == 1 and len(kids) == 1, kids  # the nodes are not up's own children
    nodes = _children(servers[0])
    # forked, not exec'd: each node's command line is the fork server's
    assert len(nodes) == 2 and all("pdkv.forkserver" in c for c in nodes.values()), nodes
    return list(nodes)


def _serving(proc) -> str:
    line = proc.stdout.readline().decode()
    while "serving the OpenAI API" not in line:
        assert line, "pdkv up exited before serving"
        line = proc.stdout.readline().decode()
    return line


@pytest.mark.parametrize("fork", [True, False], ids=["fork", "no-fork"])
def test_up_serves_through_both_nodes_and_stops_both(tiny_model_dir, tmp_path, fork):
    path = _cluster_file(tmp_path, tiny_model_dir, fork=fork)
    api, pport, cport = free_port(), free_port(), free_port()
    proc = subprocess.Popen([sys.executable, "-m", "pdkv", "up", "-c", str(path), "--set", f"server.port={api}",
                             "--set", f"prefill.server.port={pport}", "--set",
                             f"prefill.messenger.control_port={cport}", "--log-level", "warning"],
                            cwd=str(ROOT), stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        line = _serving(proc)
        assert f":{api}/v1" in line and f"control port {cport}" in line
        nodes = _nodes_of(proc.pid, fork)
        prompt = [5, 17, 42, 99, 7, 123, 64, 3, 250, 31]
        body = json.dumps({"prompt": prompt, "max_tokens": 4, "temperature": 0, "ignore_eos": True,
                           "return_token_ids": True}).encode()
        req = urllib.request.Request(f"http://127.0.0.1:{api}/v1/completions", body,
                                     {"Content-Type": "application/json"})
        out = json.loads(urllib.request.urlopen(req, timeout=30).read())
        assert out["usage"]["completion_tokens"] == 4
        assert out["choices"][0]["token_ids"] == _reference_tokens(tiny_model_dir, prompt, 4)
        pre = json.loads(urllib.request.urlopen(f"http://127.0.0.1:{pport}/health").read())
        assert pre["role"] == "prefill" and pre["decode_nodes"] == 1
        metrics = urllib.request.urlopen(f"http://127.0.0.1:{pport}/metrics").read().decode()
        sent = [x for x in metrics.splitlines() if x.startswith("pdkv_kv_transfer_bytes_total")]
        assert sent and float(sent[0].split()[-1]) > 0, sent
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(40) == 0
    for pid in nodes:
        assert not os.path.exists(f"/proc/{pid}"), f"node {pid} outlived pdkv up"
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


def _reference_tokens(model_dir, prompt: list[int], n: int) -> list[int]:
    """Greedy continuation of ``prompt`` by transformers (the reference), ``n`` tokens, EOS ignored."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False)
    return out[0, len(prompt):].tolist()


def test_a_forked_node_killed_stops_up_and_the_other_node(tiny_model_dir, tmp_path):
    """A node that dies (SIGKILL) ends `pdkv up` with status 1; the other node and the fork
    server go with it."""
    path = _cluster_file(tmp_path, tiny_model_dir, fork=True)
    proc = subprocess.Popen([sys.executable, "-m", "pdkv", "up", "-c", str(path), "--set", f"server.port={free_port()}",
                             "--set", f"prefill.server.port={free_port()}", "--log-level", "warning"],
                            cwd=str(ROOT), stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        _serving(proc)
        server = next(p for p, c in _children(proc.pid).items() if "pdkv.forkserver" in c)
        victim, other = _nodes_of(proc.pid, True)
        os.kill(victim, signal.SIGKILL)
        assert proc.wait(60) == 1
        rest = proc.stdout.read().decode()
        assert "exited with status -9; stopping" in rest, rest
        for pid in (other, server):
            end = time.time() + 10
            while os.path.exists(f"/proc/{pid}") and open(f"/proc/{pid}/stat").read().split()[2] != "Z" \
                    and time.time() < end:
                time.sleep(0.1)
            assert not os.path.exists(f"/proc/{pid}") or open(f"/proc/{pid}/stat").read().split()[2] == "Z", pid
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_up_names_a_bad_fork_value(tiny_model_dir, tmp_path):
    path = _cluster_file(tmp_path, tiny_model_dir, fork="sometimes")
    r = subprocess.run([sys.executable, "-m", "pdkv", "up", "-c", str(path)], cwd=str(ROOT),
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2
    assert f"{path}: fork must be true or false" in r.stderr and "'sometimes'" in r.stderr, r.stderr
