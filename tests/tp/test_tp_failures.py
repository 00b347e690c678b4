"""A tensor-parallel engine fails clearly and leaks nothing: a model that cannot be split is
refused before any process starts, a follower that dies (idle, or in the middle of a forward
pass) turns the step into finish_reason "error" plus a TPRankError naming the rank, never a hang,
and no follower process outlives a failed start."""

from __future__ import annotations

import gc
import os
import signal
import time
from pathlib import Path

import pytest

from pdkv.engine import SamplingParams
from pdkv.errors import ModelLoadError
from pdkv.tp import TPRankError

GREEDY = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)


_BEFORE: set[int] = set()


@pytest.fixture(autouse=True)
def _workers_before():
    """The workers alive when a test starts are not its own: session-wide TP engines of other
    files (tests/tp/conftest.py) that ran earlier on this test worker keep theirs."""
    _BEFORE.clear()
    _BEFORE.update(_workers(everyone=True))


def _workers(everyone: bool = False) -> list[int]:
    """Live pdkv.tp.worker children of this process that the running test started (``everyone``:
    all of them)."""
    out = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            cmd = (d / "cmdline").read_bytes()
        except (OSError, IndexError, ValueError):
            continue
        if ppid == os.getpid() and b"pdkv.tp.worker" in cmd:
            state = (d / "stat").read_text().rsplit(")", 1)[1].split()[0]
            if state != "Z" and (everyone or int(d.name) not in _BEFORE):
                out.append(int(d.name))
    return out


def _wait_no_workers(timeout: float = 20.0) -> list[int]:
    deadline = time.monotonic() + timeout
    while (left := _workers()) and time.monotonic() < deadline:
        gc.collect()
        time.sleep(0.1)
    return left


def test_unsplittable_model_refused_before_spawning(tp):
    d = tp.model_dir("llama", 2)  # 4 query heads
    with pytest.raises(ModelLoadError, match=r"parallel.tp=3 must divide num_attention_heads=4"):
        tp.engine(d, 3)
    assert _workers() == []
    d = tp.model_dir("llama", 2, intermediate_size=66)  # 4 heads split 4 ways fine; 66 / 4 is not whole
    with pytest.raises(ModelLoadError, match=r"parallel.tp=4 must divide intermediate_size=66"):
        tp.engine(d, 4)


def test_failed_start_leaves_no_process(tp, tmp_path):
    import shutil

    bad = tmp_path / "truncated"
    shutil.copytree(tp.model_dir("llama", 2), bad)
    weights = bad / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    with pytest.raises(ModelLoadError, match="model.safetensors"):
        tp.engine(bad, 2)
    assert _wait_no_workers() == []


def _kill(pid: int) -> None:
    os.kill(pid, signal.SIGKILL)


def test_dead_follower_gives_clear_error_not_hang(tp):
    engine = tp.engine(tp.model_dir("llama", 2), 2)
    try:
        assert [o.finish_reason for o in engine.generate(tp.PROMPTS[:1], GREEDY)] == ["length"]
        pid = engine.tp.pids[0]

        # 1) killed in the middle of a forward pass: rank 0's next all-reduce fails.
        def hook(layer: int) -> None:
            if layer == 0 and engine.tp.pids and _workers():
                _kill(pid)
                while pid in _workers():
                    time.sleep(0.01)
        engine.connector.after_layer = hook
        outs = engine.generate(tp.PROMPTS[:2], GREEDY)
        assert [o.finish_reason for o in outs] == ["error", "error"]
        with pytest.raises(TPRankError, match=rf"tensor-parallel rank 1 \(pid {pid}\) exited with code -9"):
            engine.tp.check()

        # 2) every later step fails at once, with the same error, and gives its pages back.
        engine.connector.after_layer = None
        assert [o.finish_reason for o in engine.generate(tp.PROMPTS[:1], GREEDY)] == ["error"]
        assert engine.allocator.num_free == engine.allocator.num_total
    finally:
        engine.close()
    assert _workers() == []


def test_idle_follower_killed_is_caught_before_the_step(tp):
    engine = tp.engine(tp.model_dir("llama", 2), 2)
    try:
        pid = engine.tp.pids[0]
        _kill(pid)
        while pid in _workers():  # reaped by nobody yet: wait until it is a zombie
            time.sleep(0.01)
        outs = engine.generate(tp.PROMPTS[:1], GREEDY)
        assert outs[0].finish_reason == "error"
        with pytest.raises(TPRankError, match="rank 1"):
            engine.tp.check()
    finally:
        engine.close()


def test_stuck_follower_times_out_and_breaks_the_group(tp):
    # SIGSTOP: alive but never answering. The all-reduce gives up after parallel.timeout_s.
    engine = tp.engine(tp.model_dir("llama", 2), 2, timeout_s=2.0)
    try:
        pid = engine.tp.pids[0]
        os.kill(pid, signal.SIGSTOP)
        outs = engine.generate(tp.PROMPTS[:1], GREEDY)
        assert outs[0].finish_reason == "error"
        with pytest.raises(TPRankError, match=r"all-reduce failed with every rank alive .*out of step"):
            engine.tp.check()
        # Out of step for good: a later step must not pair with the stale all-reduces.
        assert engine.generate(tp.PROMPTS[:1], GREEDY)[0].finish_reason == "error"
        assert engine.allocator.num_free == engine.allocator.num_total
    finally:
        engine.close()  # kills the stopped follower rather than waiting for it
    assert _workers() == []
