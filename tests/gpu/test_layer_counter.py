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


def test_layer_targets_follow_from_the_step_base():
    # The runner's arithmetic: a step over L layers starting at base b queues layer i at b + i + 1.
    counter, num_layers = CpuLayerCounter(), 4
    reached = []
    for step in range(3):
        base = counter.value()
        for layer in range(num_layers):
            counter.bump()
            reached.append(counter.value() >= base + layer + 1 and counter.value() < base + layer + 2)
    assert all(reached) and counter.value() == 12
