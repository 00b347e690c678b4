"""A later prefill chunk must take SDPA's fused kernel, not the math kernel.

The cause of "chunked prefill makes decode stalls worse": a chunk that attends over earlier
chunks' KV (q_len < kv_len) was run as a 3-D SDPA call with a [group * q_len, kv_len] mask,
which PyTorch sends to its math kernel (scores materialized in float32, ~5x the fused kernel on
the CPU), so the last chunk of a 1,500-token prompt cost more than prefilling the whole prompt
in one step. These tests run the torch backend on a real paged cache and check every SDPA call
it makes with ``torch._fused_sdp_choice`` (the dispatcher's own decision), plus the result
against attention written out by hand in float64.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pdkv.models.attention import AttentionBatch
from pdkv.models.attention.torch_backend import TorchAttentionBackend
from pdkv.kv import KVCache

if not hasattr(torch, "_fused_sdp_choice"):
    pytest.skip("this torch has no _fused_sdp_choice to ask", allow_module_level=True)

MATH = int(torch.nn.attention.SDPBackend.MATH.value)
HQ, HKV, D, P = 8, 2, 16, 16


def _reference(q, keys, values, kv_len, q_len, window=None):
    """q: [n, Hq, D]; keys/values: [L, Hkv, D] → [n, Hq * D], float64, causal from the bottom right."""
    G = HQ // HKV
    k = keys.double().repeat_interleave(G, 1).transpose(0, 1)  # [Hq, L, D]
    v = values.double().repeat_interleave(G, 1).transpose(0, 1)
    s = q.double().transpose(0, 1) @ k.transpose(-1, -2) * D ** -0.5  # [Hq, n, L]
    qp = torch.arange(kv_len - q_len, kv_len)[:, None]
    kp = torch.arange(kv_len)[None]
    ok = kp <= qp
    if window is not None:
        ok &= kp > qp - window
    s = s.masked_fill(~ok, float("-inf"))
    return (s.softmax(-1) @ v).transpose(0, 1).reshape(q_len, -1)


@pytest.mark.parametrize("layout", ["HND", "NHD"])
@pytest.mark.parametrize("window", [None, 24])
def test_later_chunk_takes_the_fused_kernel_and_is_exact(monkeypatch, layout, window):
    torch.manual_seed(0)
    kv = KVCache(1, 16, P, HKV, D, torch.float32, layout, "cpu")
    backend = TorchAttentionBackend(kv, HQ, HKV, D, D ** -0.5, sliding_window=window)
    # One sequence's history: 40 tokens already in its pages (earlier chunks), then a 24-token
    # chunk; beside it two decodes and a first chunk, as a mixed step has them.
    pages = [3, 7, 1, 9]
    hist_k, hist_v = torch.randn(40, HKV, D), torch.randn(40, HKV, D)
    first = AttentionBatch([40], [40], [pages], 0)
    backend.forward(0, torch.randn(40, HQ, D), hist_k, hist_v, backend.plan(first))

    calls = []
    real = F.scaled_dot_product_attention

    def spy(*args, **kw):
        calls.append(int(torch._fused_sdp_choice(*args, **kw)))
        return real(*args, **kw)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    batch = AttentionBatch([1, 1, 24, 20], [5, 9, 64, 20], [[11], [12], pages, [13, 14]], 2)
    T = batch.num_tokens
    q, k, v = torch.randn(T, HQ, D), torch.randn(T, HKV, D), torch.randn(T, HKV, D)
    out = backend.forward(0, q, k, v, backend.plan(batch))

    assert len(calls) == 2, calls  # one per prefill chunk (the decodes use batched matmuls)
    assert MATH not in calls, f"a prefill chunk took SDPA's math kernel: {calls}"
    later = out[2:26]
    want = _reference(q[2:26], torch.cat([hist_k, k[2:26]]), torch.cat([hist_v, v[2:26]]), 64, 24, window)
    torch.testing.assert_close(later.double(), want, atol=1e-5, rtol=1e-5)
    first_chunk = _reference(q[26:], k[26:], v[26:], 20, 20, window)
    torch.testing.assert_close(out[26:].double(), first_chunk, atol=1e-5, rtol=1e-5)
