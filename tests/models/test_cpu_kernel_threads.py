"""The CPU kernels split across OpenMP threads (pdkv/kernels/pool.h): every output is the same
bits on 1, 2 or 3 threads (more threads than this machine's cores included), from two Python
threads calling at once, and in a forked child of a process whose threads already ran."""
from __future__ import annotations

import os
import threading

import pytest
import torch
import torch.nn.functional as F

from pdkv.kv import KVCache
from pdkv.models import cpu_kernels
from pdkv.models.attention import cpu_decode

pytestmark = pytest.mark.skipif(not cpu_kernels.AVAILABLE, reason="the CPU kernels need x86-64 with AVX2+FMA")

THREADS = (1, 2, 3)


@pytest.fixture(autouse=True)
def _restore_threads():
    before = cpu_kernels.threads(), torch.get_num_threads()
    yield
    cpu_kernels.set_threads(before[0])
    torch.set_num_threads(before[1])


def _on(threads, fn, *args):
    cpu_kernels.set_threads(threads)
    with torch.inference_mode():
        return fn(*args)


@pytest.mark.parametrize("m", [1, 3, 8, 33, 64])
@pytest.mark.parametrize("n", [16, 200, 1536])  # one block (never split), a ragged last block, many blocks
def test_linear_is_the_same_bits_on_any_thread_count(m, n):
    g = torch.Generator().manual_seed(m * 1000 + n)
    x, w, b = torch.randn(m, 512, generator=g), torch.randn(n, 512, generator=g), torch.randn(n, generator=g)
    outs = [_on(t, cpu_kernels.linear, x, w, b) for t in THREADS]
    assert all(torch.equal(outs[0], o) for o in outs[1:])
    assert torch.allclose(outs[0], F.linear(x.double(), w.double(), b.double()).float(), rtol=1e-4, atol=1e-4)


def test_a_large_call_splits_and_a_small_one_does_not():
    """The pool's count of split calls: a 8 x 1024 x 1024 GEMM on 2 threads splits (same bits as
    one thread and as its two column halves on one), a 1 x 64 x 32 one does not (waking a worker
    would cost more than it), nor does anything on one thread."""
    from pdkv import _kernels as k

    x, w = torch.randn(8, 1024), torch.randn(1024, 1024)
    before = k.split_calls()
    y1 = _on(1, cpu_kernels.linear, x, w)
    halves = torch.cat([_on(1, cpu_kernels.linear, x, w[:512]), _on(1, cpu_kernels.linear, x, w[512:])], dim=1)
    assert k.split_calls() == before
    y2 = _on(2, cpu_kernels.linear, x, w)
    assert k.split_calls() == before + 1
    assert torch.equal(y1, y2) and torch.equal(y2, halves)
    _on(2, cpu_kernels.linear, torch.randn(1, 64), torch.randn(32, 64))
    assert k.split_calls() == before + 1


@pytest.mark.parametrize("m", [1, 8, 40])
def test_gated_mlp_and_bmm_are_the_same_bits_on_any_thread_count(m):
    g = torch.Generator().manual_seed(m)
    h, inter = 256, 704
    x = torch.randn(m, h, generator=g)
    gate_up, down = torch.randn(2 * inter, h, generator=g) / 16, torch.randn(h, inter, generator=g) / 16
    outs = [_on(t, cpu_kernels.gated_mlp, x, gate_up, down, inter) for t in THREADS]
    assert all(torch.equal(outs[0], o) for o in outs[1:])
    xb, wb = torch.randn(4, m, 256, generator=g), torch.randn(4, 512, 256, generator=g).transpose(1, 2)
    outs = [_on(t, cpu_kernels.bmm, xb, wb) for t in THREADS]
    assert all(torch.equal(outs[0], o) for o in outs[1:])
    assert torch.allclose(outs[0], torch.bmm(xb, wb), rtol=1e-4, atol=1e-3)


@pytest.mark.skipif(not cpu_kernels.BF16, reason="needs AVX512-BF16")
def test_bf16_linear_is_the_same_bits_on_any_thread_count(monkeypatch):
    monkeypatch.setattr(cpu_kernels, "MAX_ROWS_BF16", cpu_kernels.BF16_KERNEL_ROWS)  # the kernel, AMX or not
    g = torch.Generator().manual_seed(5)
    x, w = torch.randn(8, 768, generator=g).bfloat16(), torch.randn(1024, 768, generator=g).bfloat16()
    outs = [_on(t, cpu_kernels.linear, x, w) for t in THREADS]
    assert all(torch.equal(outs[0], o) for o in outs[1:])


def _attend(threads, kv, q, pages, lens, hkv, group, d, window=None):
    cpu_kernels.set_threads(threads)
    return cpu_decode.decode(kv.layer(0), True, q, pages, lens, window, hkv, group, d, d ** -0.5)


@pytest.mark.parametrize("batch,hkv,group", [(1, 4, 2), (1, 1, 8), (5, 2, 4), (7, 1, 1)],
                         ids=["one-seq-heads", "one-seq-one-head", "gqa", "mqa"])
@pytest.mark.parametrize("window", [None, 100])
def test_decode_attention_is_the_same_bits_on_any_thread_count(batch, hkv, group, window):
    """Parts are runs of (sequence, KV head) balanced by keys: one long sequence among short
    ones, a single sequence (split by heads), a single head (no split)."""
    P, d = 16, 64
    lens = [900, 3, 17, 260, 1, 640, 33][:batch]
    need = [-(-n // P) for n in lens]
    kv = KVCache(1, sum(need) + 3, P, hkv, d, torch.float32, "HND", "cpu", kv_parts=2)
    g = torch.Generator().manual_seed(batch * 10 + hkv)
    kv.layer(0).copy_(torch.randn(kv.layer(0).shape, generator=g))
    order = torch.randperm(sum(need) + 3, generator=g).tolist()
    table, at = torch.zeros(batch, max(need), dtype=torch.long), 0
    for i, k in enumerate(need):
        table[i, :k] = torch.tensor(order[at:at + k])
        at += k
    q = torch.randn(batch, hkv * group, d, generator=g)
    lens_t = torch.tensor(lens, dtype=torch.long)
    outs = [_attend(t, kv, q, table, lens_t, hkv, group, d, window) for t in THREADS]
    assert all(torch.equal(outs[0], o) for o in outs[1:])
    # and right: the first sequence against a float64 softmax over its gathered keys
    n = lens[0]
    view = kv.layer(0).permute(1, 2, 0, 3, 4)[:, :, table[0, :need[0]]].reshape(2, hkv, -1, d)[:, :, :n].double()
    keys, values = view[0], view[1]
    if window is not None and n > window:
        keys, values = keys[:, n - window:], values[:, n - window:]
    qs = q[0].double().view(hkv, group, d)
    ref = torch.softmax(qs @ keys.transpose(1, 2) * d ** -0.5, dim=-1) @ values
    assert torch.allclose(outs[0][0].double(), ref.reshape(-1), rtol=1e-4, atol=1e-5)


def test_two_python_threads_calling_at_once_get_their_own_results():
    """One call holds the team; a second caller meanwhile runs its parts itself (no wait, no
    mixing of the two calls' parts)."""
    cpu_kernels.set_threads(2)
    g = torch.Generator().manual_seed(3)
    xs = [torch.randn(8, 512, generator=g) for _ in range(2)]
    ws = [torch.randn(2048, 512, generator=g) for _ in range(2)]
    want = [_on(1, cpu_kernels.linear, x, w) for x, w in zip(xs, ws)]
    cpu_kernels.set_threads(2)
    bad, go = [], threading.Barrier(2)

    def hammer(i):
        go.wait()
        with torch.inference_mode():
            for _ in range(200):
                if not torch.equal(cpu_kernels.linear(xs[i], ws[i]), want[i]):
                    bad.append(i)
                    return

    ts = [threading.Thread(target=hammer, args=(i,)) for i in range(2)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in ts) and bad == []


def test_a_forked_child_runs_its_calls_without_the_parent_s_threads():
    """fork() copies no OpenMP thread: the child's split calls run every part on the caller
    instead of waiting for threads that do not exist (the hang this guards against), with the
    same bits."""
    x, w = torch.randn(8, 1024), torch.randn(1024, 1024)
    want = _on(1, cpu_kernels.linear, x, w)
    _on(2, cpu_kernels.linear, x, w)  # the parent's OpenMP team exists now
    r, wfd = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: no pytest from here, only os._exit
        try:
            cpu_kernels.set_threads(2)
            with torch.inference_mode():
                ok = all(torch.equal(cpu_kernels.linear(x, w), want) for _ in range(20))
            os.write(wfd, b"1" if ok else b"0")
        finally:
            os._exit(0)
    os.close(wfd)
    import select

    ready, _, _ = select.select([r], [], [], 60)
    got = os.read(r, 1) if ready else b""
    os.close(r)
    if not ready:
        os.kill(pid, 9)
    os.waitpid(pid, 0)
    assert got == b"1", "the forked child's split GEMM hung or gave other bits"


def test_the_runner_gives_the_kernels_the_step_s_thread_count():
    from pdkv.engine.runner import ModelRunner

    ModelRunner._set_threads(2)
    assert cpu_kernels.threads() == 2 and torch.get_num_threads() == 2
    ModelRunner._set_threads(1)
    assert cpu_kernels.threads() == 1 and torch.get_num_threads() == 1
