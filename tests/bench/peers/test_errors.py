"""Bad flags exit 2 naming the flag; a peer that dies or never answers is named with its log's
tail; a stopped peer leaves no process behind, children included."""
from __future__ import annotations

import contextlib
import io
import os
import sys
import textwrap
import time

import pytest

from pdkv.bench.ab.launch import LaunchError
from pdkv.bench.peers.cli import main
from pdkv.bench.peers.servers import PeerServer
from pdkv.ports import free_port


def _run(argv):
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        rc = main(argv)
    return rc, err.getvalue()


@pytest.mark.parametrize("extra,match", [
    ([], "--peer vllm needs --vllm-python PATH"),
    (["--vllm-python", "/nonexistent/venv"], "--vllm-python /nonexistent/venv: no executable"),
    (["--vllm-python", sys.executable], "cannot import vllm"),
    (["--peer", "pdkv-standin", "--aiperf", "/nonexistent/aiperf"], "--aiperf /nonexistent/aiperf: no executable"),
    (["--peer", "pdkv-standin", "--client", "aiperf"], "--client aiperf needs --aiperf PATH"),
    (["--peer", "pdkv-standin", "--concurrency", "1,x"], "--concurrency must be comma-separated integers"),
    (["--peer", "pdkv-standin", "--concurrency", "0"], "at least 1"),
    (["--peer", "pdkv-standin", "--kv-gib", "0"], "--kv-gib must be a whole number"),
    (["--peer", "pdkv-standin", "--rounds", "0"], "--rounds must be at least 1"),
    (["--peer", "pdkv-standin", "--cpus", "4096"], "--cpus 4096"),
])
def test_bad_input_exits_2_naming_the_flag(tiny_model_dir, tmp_path, extra, match):
    rc, err = _run(["--model", str(tiny_model_dir), "--out", str(tmp_path), *extra])
    assert rc == 2, err
    assert match in err


def test_not_a_model_folder(tmp_path):
    rc, err = _run(["--model", str(tmp_path), "--peer", "pdkv-standin", "--out", str(tmp_path)])
    assert rc == 2 and "not a Hugging Face model folder" in err


def test_pdkv_that_does_not_start_exits_1_naming_its_node(tiny_model_dir, tmp_path):
    rc, err = _run(["--model", str(tiny_model_dir), "--peer", "pdkv-standin", "--set", "kv_cache.page_size=0",
                    "--duration", "1", "--rounds", "1", "--out", str(tmp_path)])
    assert rc == 1, err
    assert "a server did not start: node colocated-colocated-0" in err and "page_size" in err


def _server(tmp_path, script: str, port: int) -> PeerServer:
    cmd = [sys.executable, "-c", textwrap.dedent(script)]
    return PeerServer("test-peer", cmd, dict(os.environ), tuple(sorted(os.sched_getaffinity(0)))[:1], port,
                      tmp_path / "peer.log")


def test_peer_that_exits_is_named_with_its_log_tail(tmp_path):
    s = _server(tmp_path, "print('no such ' + 'model here', flush=True); raise SystemExit(3)", free_port())
    with pytest.raises(LaunchError, match=r"(?s)test-peer exited with status 3 .*\nno such model here"):
        s.start(30)
    s.stop()


def test_peer_that_never_answers_times_out_and_is_killed(tmp_path):
    s = _server(tmp_path, "import time; print('load' + 'ing', flush=True); time.sleep(300)", free_port())
    with pytest.raises(LaunchError, match=r"(?s)did not answer .*/v1/models within 1 s.*\nloading"):
        s.start(1)
    proc = s.proc
    s.stop()
    assert proc.poll() is not None and s.proc is None
    s.stop()  # a second stop is a no-op


def test_stop_takes_the_peers_children_too(tmp_path):
    """The peer forks an engine-core-like child, then serves /v1/models; stop() ends both."""
    port = free_port()
    pid_file = tmp_path / "child.pid"
    s = _server(tmp_path, f"""
        import http.server, subprocess, sys
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
        open({str(pid_file)!r}, "w").write(str(child.pid))
        class H(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                self.send_response(200); self.end_headers(); self.wfile.write(b'{{"data": []}}')
        http.server.HTTPServer(("127.0.0.1", {port}), H).serve_forever()
    """, port)
    try:
        s.start(60)
        assert os.sched_getaffinity(s.proc.pid) == set(s.cpus)  # pinned like taskset -c
        child = int(pid_file.read_text())
        os.kill(child, 0)  # alive
    finally:
        s.stop()
    end = time.monotonic() + 10  # init reaps the orphan a moment later
    while _alive(child) and time.monotonic() < end:
        time.sleep(0.1)
    assert not _alive(child)


def _alive(pid: int) -> bool:
    """Running (a zombie waiting for init to reap it counts as gone)."""
    try:
        return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False
