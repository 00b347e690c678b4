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
    engine.runner.set_layer_hook(hook)
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
        engine.runner.set_layer_hook(None)
        a.close()
        b.close()
    # at layer i: the counter read base + i + 1, exactly i + 1 of the step's batches had left,
    # and layers 0..i (not i + 1) held the step's K/V
    assert seen == [(i, i + 1, i + 1, i + 1) for i in range(num_layers)] * 3
