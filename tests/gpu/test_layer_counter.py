"""The CPU layer counter: the same interface the CUDA one has, read the way the poller reads it."""

from __future__ import annotations

import ctypes
import threading

import pytest

from pdkv.gpu.layer_counter import CpuLayerCounter, make_layer_counter


@pytest.mark.parametrize("device", ["cpu", "CPU_AS_TORCH_DEVICE"])
def test_make_layer_counter_picks_the_cpu_counter(device):
    if device == "CPU_AS_TORCH_DEVICE":
        import torch

        device = torch.device("cpu")
    counter = make_layer_counter(device)
    assert isinstance(counter, CpuLayerCounter) and counter.value() == 0
    counter.close()


def test_bumps_are_visible_at_the_host_address():
    counter = CpuLayerCounter()
    cell = ctypes.c_int64.from_address(counter.host_address)  # what the C poller dereferences
    assert cell.value == 0
    for i in range(1, 6):
        counter.bump()
        assert cell.value == counter.value() == i


def test_a_watching_thread_sees_every_step_in_order():
    """One writer (the model runner) bumps per layer; a watcher (the poller's role) only ever
    sees the value grow, and sees it reach the end."""
    counter = CpuLayerCounter()
    num_layers, num_steps = 32, 200
    target = num_layers * num_steps
    cell = ctypes.c_int64.from_address(counter.host_address)
    seen: list[int] = []
    done = threading.Event()

    def watch():
        last = 0
        while not done.is_set() or last < target:
            v = cell.value
            if v != last:
                seen.append(v)
                last = v

    watcher = threading.Thread(target=watch)
    watcher.start()
    for _ in range(num_steps):
        for _ in range(num_layers):
            counter.bump()
    done.set()
    watcher.join(30)
    assert not watcher.is_alive()
    assert seen[-1] == target == counter.value()
    assert all(a < b for a, b in zip(seen, seen[1:])), "the counter went backwards"


def test_at_layer_i_of_a_forward_the_counter_reads_base_plus_i_plus_1(tiny_model_dir):
    """The runner's layer hook bumps the counter as pdkv.disagg.prefill wires it; inside the hook
    for layer i of a step that started at ``base`` the counter reads base + i + 1, and the C
    poller (watching it, fake transport) has posted exactly the batches queued at targets up to
    base + i + 1 -- layer i's, not layer i + 1's -- while the forward is still running, when
    layer i's K/V of the step are already in the cache and layer i + 1's are not."""
    import time

    import numpy as np

    from pdkv._messenger import Messenger
    from pdkv.config import KVCacheConfig, ModelConfig, SchedulerConfig
    from pdkv.engine import LLMEngine, SamplingParams

    engine = LLMEngine(ModelConfig(path=str(tiny_model_dir)), KVCacheConfig(page_size=16, num_pages=32),
                       SchedulerConfig())
    num_layers = engine.kv.num_layers
    counter = CpuLayerCounter()
    a, b = Messenger("fake", 1), Messenger("fake", 2)
    src, dst = np.ones(4096, dtype=np.uint8), np.zeros(4096, dtype=np.uint8)
    lkey, rkey = a.register(src), b.register(dst)
    b.grant(rkey, 1)
    ca, ia = a.prepare(2)
    cb, ib = b.prepare(1)
    a.complete(ca, ib)
    b.complete(cb, ia)
    watch = a.watch_address(counter.host_address)
    seen, base, pos = [], [0], [0]

    def hook(layer: int) -> None:
        counter.bump()  # what the prefill node's hook does after the layer's output projection
        deadline = time.monotonic() + 10  # a hang guard: the poller posts within microseconds
        while a.stats()["posted_batches"] < posted_before[0] + layer + 1 and time.monotonic() < deadline:
            time.sleep(0.0005)
        # and layer i's K/V of the step's last token are in the cache, layer i + 1's not yet
        req = engine.requests["r"]
        page, off = req.pages[pos[0] // 16], pos[0] % 16
        written = [bool(engine.kv.layer(j)[page, :, :, off].abs().sum() > 0) for j in range(num_layers)]
        seen.append((layer, counter.value() - base[0], a.stats()["posted_batches"] - posted_before[0],
                     written.index(False) if False in written else num_layers))

    posted_before = [0]
    engine.connector.after_layer = hook
    try:
        engine.add_request("r", list(range(1, 20)), SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
        for _ in range(3):  # prefill + 2 decodes: three forward passes
            base[0], posted_before[0] = counter.value(), a.stats()["posted_batches"]
            pos[0] = engine.requests["r"].num_tokens - 1  # the position this step writes last
            for layer in range(num_layers):  # queue every layer before the forward, as prefill does
                a.queue_pages(watch, base[0] + layer + 1, ca, lkey, rkey, [layer], [layer], seg_len=64,
                              src_page_stride=64, dst_page_stride=64)
            engine.step()
            assert counter.value() == base[0] + num_layers
    finally:
        engine.connector.after_layer = None
        a.close()
        b.close()
    # at layer i: the counter read base + i + 1, exactly i + 1 of the step's batches had left,
    # and layers 0..i (not i + 1) held the step's K/V
    assert seen == [(i, i + 1, i + 1, i + 1) for i in range(num_layers)] * 3


# ---- which kernel bumps a CUDA counter (the choice is host logic; the kernel runs below) ----

from pdkv.gpu.layer_counter import BumpKind, choose_bump  # noqa: E402


def _triton_works():
    return lambda t: None


def _triton_missing():
    raise ImportError("No module named 'triton'")


def test_auto_prefers_the_triton_release_bump():
    kind, fn, reason = choose_bump("auto", _triton_works)
    assert kind is BumpKind.TRITON_RELEASE_SYS and fn is not None and reason is None


def test_auto_falls_back_to_torch_add_and_says_why(caplog):
    with caplog.at_level("WARNING", logger="pdkv.gpu.layer_counter"):
        kind, fn, reason = choose_bump("auto", _triton_missing)
    assert kind is BumpKind.TORCH_ADD and fn is None
    assert reason == "ImportError: No module named 'triton'"
    assert "not a system-scope release" in caplog.text and "No module named 'triton'" in caplog.text


def test_triton_asked_for_explicitly_never_falls_back():
    with pytest.raises(RuntimeError, match=r"bump='triton'.*not usable here \(ImportError: No module named"):
        choose_bump("triton", _triton_missing)


def test_torch_asked_for_does_not_load_triton():
    def must_not_load():
        raise AssertionError("triton was loaded for bump='torch'")

    assert choose_bump("torch", must_not_load)[0] is BumpKind.TORCH_ADD
    with pytest.raises(ValueError, match="bump must be one of auto, triton, torch, got 'cuda'"):
        choose_bump("cuda", _triton_works)


def test_cpu_counter_says_what_it_is():
    assert CpuLayerCounter().bump_kind is BumpKind.CPU_ATOMIC


_INTERPRET = """
import os, sys, torch
from pdkv.gpu import release_bump
word = torch.zeros(1, dtype=torch.int64)
release_bump.warm_up("cpu")            # the start-up self-test, on a scratch word
for _ in range(7):
    release_bump.bump(word)
print(int(word.item()))
"""


def test_the_triton_release_kernel_increments_by_one_per_launch():
    """The real kernel source, run by Triton's interpreter on the CPU (TRITON_INTERPRET=1): one
    launch adds exactly 1 with the release/sys atomic. Skipped where triton is not installed."""
    import importlib.util
    import os
    import subprocess
    import sys
    from pathlib import Path

    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed (a GPU extra, requirements-gpu.txt)")
    repo = Path(__file__).resolve().parents[2]
    env = dict(os.environ, TRITON_INTERPRET="1",
               PYTHONPATH=os.pathsep.join([str(repo), os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run([sys.executable, "-c", _INTERPRET], capture_output=True, text=True, env=env,
                         timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1] == "7"
