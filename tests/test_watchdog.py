"""The suite's watchdog (tests/_watchdog.py) ends a test that pytest-timeout cannot, and what the
test started with it."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.parametrize("test", ["test_hangs_in_c_with_a_child", "test_hangs_holding_the_gil"])
def test_a_test_stuck_in_c_is_ended_with_its_children_and_its_stacks_printed(tmp_path, test):
    pid_file = tmp_path / "child.pid"
    env = dict(os.environ, PDKV_TEST_WATCHDOG_MARGIN_S="2", HANG_CHILD_PID_FILE=str(pid_file))
    t0 = time.monotonic()
    p = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:xdist", "--timeout", "1",
                        f"tests/fixtures/hang/test_hang_in_c.py::{test}"], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=120)
    took = time.monotonic() - t0
    assert p.returncode == -signal.SIGKILL, p.stdout + p.stderr
    assert f"[test watchdog] tests/fixtures/hang/test_hang_in_c.py::{test} still running" in p.stderr
    dump = p.stderr.split("[test watchdog]", 1)[1]
    assert f'test_hang_in_c.py", line' in dump and f"in {test}" in dump  # the stuck frame is named
    assert took < 60
    child = int(pid_file.read_text())
    deadline = time.monotonic() + 10
    while _alive(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(child)


def test_descendants_finds_children_and_grandchildren():
    """What the watchdog kills: every process below the worker (pdkv.bench.ab.launch.descendants)."""
    from pdkv.bench.ab.launch import descendants

    p = subprocess.Popen([sys.executable, "-c", "import subprocess, sys; c = subprocess.Popen(['sleep', '30']); "
                          "print(c.pid, flush=True); sys.stdin.read()"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                         text=True)
    try:
        grandchild = int(p.stdout.readline())
        found = descendants(os.getpid())
        assert {os.getpid(), p.pid, grandchild} <= set(found)
        assert found[0] == os.getpid() and descendants(grandchild) == [grandchild]  # the root first: the watchdog skips itself
    finally:
        os.kill(grandchild, 9)
        p.kill()
        p.wait()
