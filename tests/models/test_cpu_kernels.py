"""pdkv's CPU kernels (pdkv/kernels/*.c) against float64 references and against torch:
- models.cpu_kernels.linear / bmm: every shape class the kernel's loops have (K below, at and past
  the 8- and 32-wide blocks, a scalar tail; 1-16 rows, odd and even; bias; strided rows), each
  row bit-identical whatever it is batched with, and everything the kernel does not take going
  to torch unchanged;
- every GEMM path this CPU runs (avx512, avx2, pairs; forced through _kernels.set_gemm_path):
  1-64 rows, K and N off the vector width and the tiles, each row the same bits in any batch;
- models.attention.cpu_decode: decode attention over shuffled pages, both layouts, page sizes
  1/16/64, GQA groups, a latent cache, a sliding window, several sequences of different
  lengths, against a gathered float64 softmax; ids out of range are refused, nothing read.
End to end (the engine with model.cpu_kernels on and off) is in tests/models/test_cpu_kernels_engine.py."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from pdkv.models import cpu_kernels
from pdkv.models.attention import cpu_decode
from pdkv.kv import KVCache

pytestmark = [pytest.mark.skipif(not cpu_kernels.AVAILABLE, reason="pdkv._kernels is not built or the CPU lacks AVX2+FMA"),
              pytest.mark.usefixtures("one_torch_thread")]


def _rel(a: torch.Tensor, ref: torch.Tensor) -> float:
    return ((a.double() - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item()


@pytest.mark.parametrize("m", [1, 2, 3, 15, 16])
@pytest.mark.parametrize("k", [1, 7, 8, 31, 32, 33, 520])
@pytest.mark.parametrize("bias", [False, True])
def test_linear_matches_float64(m, k, bias):
    g = torch.Generator().manual_seed(m * 1000 + k)
    n = 37  # not a multiple of the 16-row tile
    x = torch.randn(m, k, generator=g)
    w = torch.randn(n, k, generator=g)
    b = torch.randn(n, generator=g) if bias else None
    with torch.inference_mode():
        y = cpu_kernels.linear(x, w, b)
    ref = x.double() @ w.double().T + (b.double() if bias else 0)
    assert y.shape == (m, n) and y.dtype == torch.float32
    assert _rel(y, ref) < 1e-5


def test_strided_rows_and_weight_views():
    """x rows and weight rows with a stride past their length (views into wider tensors)."""
    g = torch.Generator().manual_seed(3)
    wide_x, wide_w = torch.randn(5, 100, generator=g), torch.randn(40, 90, generator=g)
    x, w = wide_x[:, 10:74], wide_w[3:35, 20:84]  # [5, 64] stride 100, [32, 64] stride 90
    with torch.inference_mode():
        y = cpu_kernels.linear(x, w)
    assert _rel(y, x.double() @ w.double().T) < 1e-5
    assert torch.equal(wide_x[:, 10:74], x)  # inputs untouched


def test_a_row_gives_the_same_bits_in_any_batch():
    """Batch invariance: row r alone, in a pair, and among 16 rows is one sequence of float ops."""
    g = torch.Generator().manual_seed(4)
    x, w = torch.randn(16, 512, generator=g), torch.randn(300, 512, generator=g)
    with torch.inference_mode():
        full = cpu_kernels.linear(x, w)
        for r in (0, 5, 15):
            assert torch.equal(cpu_kernels.linear(x[r:r + 1], w), full[r:r + 1])
            assert torch.equal(cpu_kernels.linear(x[r:r + 3], w)[0], full[r])


def test_what_the_kernel_does_not_take_goes_to_torch():
    g = torch.Generator().manual_seed(5)
    w = torch.randn(24, 64, generator=g)
    with torch.inference_mode():
        big = torch.randn(cpu_kernels.MAX_ROWS + 1, 64, generator=g)  # more rows: oneDNN or MKL
        assert _rel(cpu_kernels.linear(big, w), big.double() @ w.double().T) < 1e-5
        wt = w.t().contiguous().t()  # stored [in, out]: the layout MKL's GEMV prefers
        x = torch.randn(1, 64, generator=g)
        assert torch.equal(cpu_kernels.linear(x, wt), F.linear(x, wt))
        xh, wh = x.half(), w.half()
        assert torch.equal(cpu_kernels.linear(xh, wh), F.linear(xh, wh))
        xb, wb = x.bfloat16(), w.bfloat16()  # bfloat16: the kernel only where the CPU has AVX512-BF16
        if not cpu_kernels.BF16:
            assert torch.equal(cpu_kernels.linear(xb, wb), F.linear(xb, wb))
        big_b = big[:cpu_kernels.MAX_ROWS_BF16 + 1].bfloat16()
        assert torch.equal(cpu_kernels.linear(big_b, wb), F.linear(big_b, wb))
        assert torch.equal(cpu_kernels.linear(xb, w.bfloat16().t().contiguous().t()),
                           F.linear(xb, w.bfloat16().t().contiguous().t()))
    # autograd: torch's op, so the result has a graph
    xg = torch.randn(1, 64, requires_grad=True)
    assert cpu_kernels.linear(xg, w).grad_fn is not None
    # a shape mismatch is torch's own error, never a read past the weight
    with torch.inference_mode(), pytest.raises(RuntimeError):
        cpu_kernels.linear(torch.randn(1, 65), w)
    with torch.inference_mode(), pytest.raises(RuntimeError):
        cpu_kernels.linear(torch.randn(1, 64), w, torch.randn(23))


# ---- the GEMM's ISA paths ----------------------------------------------------------------

def _runnable_paths() -> list[str]:
    from pdkv import _kernels  # noqa: PLC0415

    was, ok = _kernels.gemm_path(), []
    for p in ("avx512", "avx2", "pairs"):
        try:
            _kernels.set_gemm_path(p)
            ok.append(p)
        except ValueError:
            pass
    _kernels.set_gemm_path(was)
    return ok


PATHS = _runnable_paths() if cpu_kernels.AVAILABLE else []


@pytest.fixture(params=["avx512", "avx2", "pairs"])
def gemm_path(request):
    """Runs the test on one GEMM path (skipped where this CPU lacks it), then restores the default."""
    from pdkv import _kernels  # noqa: PLC0415

    if request.param not in PATHS:
        pytest.skip(f"this CPU cannot run the {request.param} GEMM path")
    was = _kernels.gemm_path()
    _kernels.set_gemm_path(request.param)
    yield _kernels
    _kernels.set_gemm_path(was)


def _gemm(kern, x, w, b=None):
    m, k = x.shape
    n = w.shape[0]
    y = torch.full((m, n), float("nan"))
    kern.gemm(x.data_ptr(), x.stride(0), w.data_ptr(), w.stride(0), 0 if b is None else b.data_ptr(),
              y.data_ptr(), n, m, k, n)
    return y


ROWS = [1, 2, 3, 4, 5, 6, 7, 8, 9, 12, 13, 16, 17, 31, 32, 33, 47, 63, 64]


@pytest.mark.parametrize("k", [1, 7, 15, 16, 17, 33, 520])
def test_every_path_matches_float64(gemm_path, k):
    """1-64 rows against float64; N = 37 leaves a tail of weight rows past every tile size."""
    g = torch.Generator().manual_seed(k)
    n = 37
    x, w, b = torch.randn(64, k + 3, generator=g), torch.randn(n, k, generator=g), torch.randn(n, generator=g)
    for m in ROWS:
        xm = x[:m, :k]  # rows k + 3 apart
        y = _gemm(gemm_path, xm, w, b if m % 2 else None)
        ref = xm.double() @ w.double().T + (b.double() if m % 2 else 0)
        assert _rel(y, ref) < 1e-5, (m, k)


def test_every_path_is_batch_invariant(gemm_path):
    """On one path, a row gives the same bits alone, in any block of rows and at any offset."""
    g = torch.Generator().manual_seed(9)
    x, w = torch.randn(64, 300, generator=g), torch.randn(70, 300, generator=g)
    full = _gemm(gemm_path, x, w)
    for m in ROWS:
        part = _gemm(gemm_path, x[64 - m:], w)  # the last m rows: each at another place in its block
        assert torch.equal(part, full[64 - m:]), m
    assert torch.equal(_gemm(gemm_path, x[5:6], w[3:40]), full[5:6, 3:40])  # another tile phase


def test_linear_takes_the_blocked_path_up_to_kernel_rows(gemm_path):
    g = torch.Generator().manual_seed(10)
    x, w = torch.randn(cpu_kernels.KERNEL_ROWS, 96, generator=g), torch.randn(50, 96, generator=g)
    with torch.inference_mode():
        y = cpu_kernels.linear(x, w)
    assert torch.equal(y, _gemm(gemm_path, x, w))  # the kernel's bits, not MKL's
    assert _rel(y, x.double() @ w.double().T) < 1e-5


def test_more_rows_go_to_mkl_and_with_onednn_asked_for_to_onednn():
    """Past KERNEL_ROWS a float32 linear is MKL's F.linear by default; PDKV_LINEAR_ONEDNN=1 (a
    fresh interpreter: read at import) gives oneDNN's bits there (bias included) and the kernel
    up to 16 rows only."""
    import os
    import subprocess
    import sys

    g = torch.Generator().manual_seed(12)
    x, w, b = torch.randn(70, 300, generator=g), torch.randn(700, 300, generator=g), torch.randn(700, generator=g)
    if not cpu_kernels.ONEDNN:
        assert cpu_kernels.KERNEL_ROWS == cpu_kernels.MAX_ROWS
        with torch.inference_mode():
            assert torch.equal(cpu_kernels.linear(x, w, b), F.linear(x, w, b))
    code = ("import torch, torch.nn.functional as F; from pdkv.models import cpu_kernels as c; "
            "g = torch.Generator().manual_seed(12); "
            "x, w, b = torch.randn(40, 300, generator=g), torch.randn(700, 300, generator=g), torch.randn(700, generator=g); "
            "y = c.linear(x, w, b); "
            "print(c.ONEDNN, c.KERNEL_ROWS, torch.equal(y, torch.ops.mkldnn._linear_pointwise(x, w, b, 'none', [], '')), "
            "((y.double() - torch.addmm(b.double(), x.double(), w.double().T)).abs().max() < 1e-3).item(), "
            "torch.equal(c.linear(x[:, ::2], w[:, ::2]), F.linear(x[:, ::2], w[:, ::2])))")
    out = subprocess.run([sys.executable, "-c", code], env={**os.environ, "PDKV_LINEAR_ONEDNN": "1"},
                         capture_output=True, text=True, timeout=120)
    if not torch.backends.mkldnn.is_available():
        pytest.skip("this torch has no oneDNN")
    assert out.stdout.split() == ["True", "16", "True", "True", "True"], out.stderr[-2000:]


def test_set_gemm_path_refuses_unknown_names():
    from pdkv import _kernels  # noqa: PLC0415

    was = _kernels.gemm_path()
    with pytest.raises(ValueError, match="'sse9'"):
        _kernels.set_gemm_path("sse9")
    assert _kernels.gemm_path() == was == cpu_kernels.GEMM_PATH
    assert was in ("avx512", "avx2", "pairs")


# ---- bfloat16 (AVX512-BF16) ---------------------------------------------------------------

needs_bf16 = pytest.mark.skipif(not cpu_kernels.BF16, reason="this CPU lacks AVX512-BF16")


@needs_bf16
@pytest.mark.parametrize("k", [1, 31, 32, 33, 63, 520])
def test_bf16_linear_matches_float64(k, monkeypatch):
    """Float32 sums of exact bf16 products, one rounding to bf16 at the end: within half a bf16
    ulp (2^-9 relative) of the float64 result of the same bf16 inputs, plus float32's sum error.
    Every row count the kernel can take, also where AMX leaves it only a few (MAX_ROWS_BF16)."""
    monkeypatch.setattr(cpu_kernels, "MAX_ROWS_BF16", cpu_kernels.BF16_KERNEL_ROWS)
    g = torch.Generator().manual_seed(100 + k)
    n = 37
    x, w = torch.randn(64, k, generator=g).bfloat16(), torch.randn(n, k, generator=g).bfloat16()
    b = torch.randn(n, generator=g).bfloat16()
    for m in [r for r in ROWS if r <= cpu_kernels.MAX_ROWS_BF16]:
        bias = b if m % 2 else None
        with torch.inference_mode():
            y = cpu_kernels.linear(x[:m], w, bias)
            t = F.linear(x[:m], w, bias)
        ref = x[:m].double() @ w.double().T + (b.double() if m % 2 else 0)
        assert y.dtype == torch.bfloat16 and y.shape == (m, n)
        err = ((y.double() - ref).abs() / ref.abs().clamp_min(1e-3 * ref.abs().max())).max().item()
        assert err < 2 ** -8, (m, k, err)
        assert _rel(y, t.double()) < 2 ** -7  # torch's own bf16 GEMM: a rounding apart at most


@needs_bf16
def test_bf16_rows_are_batch_invariant(monkeypatch):
    """Within the kernel's rows (where AMX sends more than a few to oneDNN, a row's bits depend
    on which of the two its step's row count chose)."""
    monkeypatch.setattr(cpu_kernels, "MAX_ROWS_BF16", cpu_kernels.BF16_KERNEL_ROWS)
    g = torch.Generator().manual_seed(11)
    x, w = torch.randn(32, 300, generator=g).bfloat16(), torch.randn(70, 300, generator=g).bfloat16()
    with torch.inference_mode():
        full = cpu_kernels.linear(x, w)
        for m in (1, 2, 5, 8, 13, 31):
            assert torch.equal(cpu_kernels.linear(x[32 - m:], w), full[32 - m:]), m


@needs_bf16
def test_bf16_rows_past_the_kernel_s_share_go_to_torch(monkeypatch):
    """MAX_ROWS_BF16 (4 where the CPU has AMX tiles, else the kernel's 32): up to it the kernel
    (its rows are the same bits whatever the batch), past it torch's GEMM, bit for bit."""
    g = torch.Generator().manual_seed(12)
    x, w = torch.randn(40, 512, generator=g).bfloat16(), torch.randn(96, 512, generator=g).bfloat16()
    assert cpu_kernels.MAX_ROWS_BF16 == (4 if cpu_kernels.AMX_BF16 else cpu_kernels.BF16_KERNEL_ROWS)
    calls = []
    real = cpu_kernels._k.gemm_bf16
    monkeypatch.setattr(cpu_kernels._k, "gemm_bf16", lambda *a: (calls.append(a[7]), real(*a))[1])
    with torch.inference_mode():
        for m in (1, cpu_kernels.MAX_ROWS_BF16, cpu_kernels.MAX_ROWS_BF16 + 1, 33):
            before = len(calls)
            y = cpu_kernels.linear(x[:m], w)
            if m <= cpu_kernels.MAX_ROWS_BF16:
                assert calls[before:] == [m]
            else:
                assert calls[before:] == [] and torch.equal(y, F.linear(x[:m], w))


@pytest.mark.parametrize("m", [1, 4])
def test_bmm_matches_float64(m):
    g = torch.Generator().manual_seed(6)
    H, K, N = 8, 64, 128
    q = torch.randn(m, H, K + 32, generator=g)[..., :K].transpose(0, 1)  # [H, m, K], strided like MLA's q_nope
    w = torch.randn(H, N, K, generator=g).transpose(1, 2)  # [H, K, N] with K contiguous
    with torch.inference_mode():
        y = cpu_kernels.bmm(q, w)
    assert y.shape == (H, m, N)
    assert _rel(y, q.double() @ w.double()) < 1e-5
    wo = w.contiguous()  # [H, K, N] with N contiguous: torch.bmm
    with torch.inference_mode():
        assert torch.equal(cpu_kernels.bmm(q, wo), torch.bmm(q, wo))


# ---- decode attention --------------------------------------------------------------------

def _reference(q, keys, values, scale, window):
    """q [Hq, D], keys [Hkv, L, D], values [Hkv, L, Dv] (float64) → [Hq * Dv]."""
    Hq, Hkv = q.shape[0], keys.shape[0]
    G, L = Hq // Hkv, keys.shape[1]
    first = max(0, L - window) if window else 0
    out = []
    for h in range(Hq):
        s = (keys[h // G, first:] @ q[h]) * scale
        out.append(torch.softmax(s, 0) @ values[h // G, first:])
    return torch.cat(out)


def _filled_cache(layout, page_size, hkv, d, parts, num_pages, seed):
    kv = KVCache(1, num_pages, page_size, hkv, d, torch.float32, layout, "cpu", kv_parts=parts)
    kv.layer(0).copy_(torch.randn(kv.layer(0).shape, generator=torch.Generator().manual_seed(seed)))
    return kv


def _gathered(kv, pages, n, hnd):
    """One sequence's [parts, Hkv, n, D] from its pages, float64."""
    c = kv.layer(0)
    view = c.permute(1, 2, 0, 3, 4) if hnd else c.permute(1, 3, 0, 2, 4)  # [parts, Hkv, pages, P, D]
    g = view[:, :, pages].reshape(c.shape[1], view.shape[1], -1, c.shape[-1])
    return g[:, :, :n].double()


@pytest.mark.parametrize("layout", ["HND", "NHD"])
@pytest.mark.parametrize("page_size", [1, 16, 64])
@pytest.mark.parametrize("shape", [(4, 4, 64, 64, 2), (4, 2, 32, 32, 2), (8, 2, 32, 32, 2), (8, 1, 96, 64, 1)],
                         ids=["mha", "gqa2", "gqa4", "latent"])
def test_decode_attention_matches_float64(layout, page_size, shape):
    Hq, Hkv, D, Dv, parts = shape
    hnd = layout == "HND"
    lens = [1, page_size + 1, 3 * page_size - 1, 150]
    need = [-(-n // page_size) for n in lens]
    num_pages = sum(need) + 5
    kv = _filled_cache(layout, page_size, Hkv, D, parts, num_pages, seed=page_size)
    order = torch.randperm(num_pages, generator=torch.Generator().manual_seed(1)).tolist()  # pages out of order
    tables, at = [], 0
    for k in need:
        tables.append(order[at:at + k])
        at += k
    width = max(need)
    pages = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.long)
    q = torch.randn(len(lens), Hq, D, generator=torch.Generator().manual_seed(2))
    scale = D ** -0.5
    out = cpu_decode.decode(kv.layer(0), hnd, q, pages, torch.tensor(lens), None, Hkv, Hq // Hkv, Dv, scale)
    for b, (n, t) in enumerate(zip(lens, tables)):
        g = _gathered(kv, t, n, hnd)
        keys, values = g[0], (g[1] if parts == 2 else g[0][..., :Dv])
        ref = _reference(q[b].double(), keys, values, scale, None)
        assert _rel(out[b], ref) < 1e-5, (b, n)


@pytest.mark.parametrize("shape", [(6, 2, 12, 12, 2), (6, 1, 12, 12, 2), (12, 1, 20, 12, 1), (3, 3, 9, 9, 2),
                                   (4, 2, 20, 20, 2)],
                         ids=["group3_d12", "group6", "group12_latent_d20_v12", "mha_d9", "group2_d20"])
def test_decode_attention_odd_groups_and_widths(shape):
    """Head groups that fill no register block (3, 6, 12 = 8 + 4) and widths off the 8-float
    vectors (9, 12, 20): the blocks' spare lanes, the scalar tails, and value widths too narrow
    for a pass of several value vectors (20 columns for 2 heads)."""
    Hq, Hkv, D, Dv, parts = shape
    P, lens = 16, [1, 23, 50]
    kv = _filled_cache("NHD", P, Hkv, D, parts, 12, seed=Hq + D)
    tables = [[3], [7, 1], [9, 0, 11, 5]]
    pages = torch.tensor([t + [0] * (4 - len(t)) for t in tables], dtype=torch.long)
    q = torch.randn(3, Hq, D, generator=torch.Generator().manual_seed(5))
    out = cpu_decode.decode(kv.layer(0), False, q, pages, torch.tensor(lens), None, Hkv, Hq // Hkv, Dv, 0.4)
    for b, (n, t) in enumerate(zip(lens, tables)):
        g = _gathered(kv, t, n, False)
        keys, values = g[0], (g[1] if parts == 2 else g[0][..., :Dv])
        assert _rel(out[b], _reference(q[b].double(), keys, values, 0.4, None)) < 1e-5, (b, n)


def test_decode_attention_sliding_window():
    P, Hkv, Hq, D = 16, 2, 4, 32
    kv = _filled_cache("HND", P, Hkv, D, 2, 12, seed=9)
    pages = torch.tensor([[3, 7, 1, 9, 0, 11]], dtype=torch.long)
    n, window = 90, 40
    q = torch.randn(1, Hq, D, generator=torch.Generator().manual_seed(3))
    out = cpu_decode.decode(kv.layer(0), True, q, pages, torch.tensor([n]), window, Hkv, 2, D, 0.3)
    g = _gathered(kv, pages[0].tolist(), n, True)
    assert _rel(out[0], _reference(q[0].double(), g[0], g[1], 0.3, window)) < 1e-5


def test_decode_attention_refuses_ids_out_of_range():
    kv = _filled_cache("HND", 16, 2, 32, 2, 4, seed=1)
    q = torch.randn(1, 4, 32)
    for pages, n in ((torch.tensor([[4]]), 3), (torch.tensor([[-1]]), 3), (torch.tensor([[0]]), 17),
                     (torch.tensor([[0]]), 0)):
        with pytest.raises(ValueError, match="out of range"):
            cpu_decode.decode(kv.layer(0), True, q, pages, torch.tensor([n]), None, 2, 2, 32, 1.0)
    before = kv.layer(0).clone()
    k, v = torch.randn(1, 2, 32), torch.randn(1, 2, 32)
    for page, slot in ((4, 0), (0, 16), (-1, 0), (0, -1)):  # a new token's slot outside the cache: nothing written
        with pytest.raises(ValueError, match="out of range"):
            cpu_decode.decode(kv.layer(0), True, q, torch.tensor([[0]]), torch.tensor([3]), None, 2, 2, 32, 1.0,
                              (k, v, torch.tensor([page]), torch.tensor([slot])))
    assert torch.equal(kv.layer(0), before)
    with pytest.raises(ValueError, match="latent cache takes none"):  # a K/V cache without the new v
        cpu_decode.decode(kv.layer(0), True, q, torch.tensor([[0]]), torch.tensor([3]), None, 2, 2, 32, 1.0,
                          (k, None, torch.tensor([0]), torch.tensor([2])))
    with pytest.raises(ValueError, match="do not agree"):  # q heads that are not Hkv * group
        cpu_decode.decode(kv.layer(0), True, torch.randn(1, 3, 32), torch.tensor([[0]]), torch.tensor([3]),
                          None, 2, 2, 32, 1.0)


@pytest.mark.parametrize("latent", [False, True])
def test_backend_decode_step_kernel_equals_torch_path(latent):
    """The torch backend's decode step through the kernel and through its own path (gather +
    SDPA / batched matmuls) give the same outputs to float32 rounding, at B = 1 and B = 3."""
    from pdkv.models.attention.base import AttentionBatch
    from pdkv.models.attention.torch_backend import TorchAttentionBackend

    P, Hq = 16, 8
    Hkv, D, Dv = (1, 96, 64) if latent else (2, 32, 32)
    kv = _filled_cache("HND", P, Hkv, D, 1 if latent else 2, 40, seed=4)
    tables = [[5, 9, 2], [30, 31], [7, 1, 17, 22]]
    lens = [40, 17, 60]
    for B in (1, 3):
        outs, caches = [], []
        for use in (True, False):
            be = TorchAttentionBackend(kv, Hq, Hkv, D, D ** -0.5, None, value_dim=Dv)
            be.use_cpu_kernel = use
            meta = be.plan(AttentionBatch([1] * B, lens[:B], tables[:B], B))
            assert (meta.decode_lens is not None) == use
            g = torch.Generator().manual_seed(B)
            q, k = torch.randn(B, Hq, D, generator=g), torch.randn(B, Hkv, D, generator=g)
            v = None if latent else torch.randn(B, Hkv, D, generator=g)
            before = kv.layer(0).clone()
            with torch.inference_mode():
                outs.append(be.forward(0, q, k, v, meta))
            caches.append(kv.layer(0).clone())
            kv.layer(0).copy_(before)  # both runs write the same new token: start again from the same cache
        assert torch.equal(caches[0], caches[1])  # the kernel stored the new K/V exactly where torch does
        assert not torch.equal(caches[0], before)
        assert outs[0].shape == outs[1].shape == (B, Hq * Dv)
        assert _rel(outs[0], outs[1].double()) < 1e-5
        assert not math.isnan(outs[0].sum().item())


@pytest.mark.parametrize("group", [1, 2, 4, 8, 3])
def test_decode_attention_softmax_far_below_the_maximum(group):
    """Sharp scores (scale 40): most exps fall below float32's range, which the kernel's vector
    exp gives as 0; the result still matches float64 (groups dividing 8 take the vector exp,
    3 the scalar one)."""
    P, Hkv, D, n = 16, 2, 16, 77
    kv = _filled_cache("HND", P, Hkv, D, 2, 8, seed=group)
    pages = torch.tensor([[5, 2, 7, 0, 3]], dtype=torch.long)
    q = torch.randn(1, Hkv * group, D, generator=torch.Generator().manual_seed(group))
    out = cpu_decode.decode(kv.layer(0), True, q, pages, torch.tensor([n]), None, Hkv, group, D, 40.0)
    g = _gathered(kv, pages[0].tolist(), n, True)
    assert _rel(out[0], _reference(q[0].double(), g[0], g[1], 40.0, None)) < 1e-5


@pytest.mark.parametrize("n", [1, 7, 8, 9, 31, 32000])
def test_argmax_is_torchs_first_maximum(n):
    """Ties go to the first index, in the full vectors or the tail; rows of -inf give 0; a row
    with a NaN (torch's maximum) and a strided or non-float32 tensor go to torch."""
    g = torch.Generator().manual_seed(n)
    x = torch.randn(6, n, generator=g)
    x[1] = 0.5  # every index ties
    x[2] = float("-inf")
    if n > 3:
        x[3, n - 1] = x[3, n - 3] = 9.0  # a tie in the tail (or the vectors) and later
    assert cpu_kernels.argmax(x) == x.argmax(-1).tolist()
    x[4, n // 2] = float("nan")  # the whole batch then goes to torch
    assert cpu_kernels.argmax(x) == x.argmax(-1).tolist()
    out = torch.empty(6, dtype=torch.long)
    assert not cpu_kernels._k.argmax_rows(x.data_ptr(), n, 6, n, out.data_ptr())
    wide = torch.randn(3, 2 * n, generator=g)[:, ::2]  # not unit stride: torch's
    assert cpu_kernels.argmax(wide) == wide.argmax(-1).tolist()
    rows = torch.randn(4, n + 5, generator=g)[:, 2:n + 2]  # a row stride past n
    assert cpu_kernels.argmax(rows) == rows.argmax(-1).tolist()
    assert cpu_kernels.argmax(x.double()) == x.double().argmax(-1).tolist()
