"""A speculative verification's k + 1 rows attend in the batched ("decode") path of the
torch backend, every row under its own causal limit, and give what attention written out by hand
in float64 gives.

Before, a sequence with more than one new token always took the per-sequence SDPA path with a
boolean mask (converted to a float mask in every layer); the batched path reads a sequence's
pages once for all of its rows. These tests pin which path a step takes and its exact result:
one sequence verifying k drafts (the batch-1 case the speed target is about), several
sequences with different numbers of drafts beside decodes (rows padded to the longest), with
and without a sliding window, on both cache layouts and on a latent (MLA) cache.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pdkv.models.attention import AttentionBatch
from pdkv.models.attention.torch_backend import MULTI_QUERY_MAX, TorchAttentionBackend
from pdkv.kv import KVCache

HQ, HKV, D, P = 4, 2, 8, 4


def _reference(q, keys, values, kv_len, q_len, window=None):
    """q: [n, Hq, D]; keys/values: [L, Hkv, Dv] → [n, Hq * Dv] in float64, causal from the end."""
    G = q.shape[1] // keys.shape[1]
    k = keys.double().repeat_interleave(G, 1).transpose(0, 1)
    v = values.double().repeat_interleave(G, 1).transpose(0, 1)
    s = q.double().transpose(0, 1) @ k.transpose(-1, -2) * D ** -0.5  # [Hq, n, L]
    qp = torch.arange(kv_len - q_len, kv_len)[:, None]
    kp = torch.arange(kv_len)[None]
    ok = kp <= qp
    if window is not None:
        ok &= kp > qp - window
    return (s.masked_fill(~ok, float("-inf")).softmax(-1) @ v).transpose(0, 1).reshape(q_len, -1)


def _step(backend, q_lens, kv_lens, page_ids, hist, latent=False):
    """Fills each sequence's cached keys (kv_len - q_len tokens, random), runs one step over the
    new tokens and returns (out, q, keys per sequence, values per sequence, meta)."""
    hkv = 1 if latent else HKV
    for (n, L, pages), (hk, hv) in zip(zip(q_lens, kv_lens, page_ids), hist):
        if L - n:
            backend.forward(0, torch.randn(L - n, HQ, D), hk, None if latent else hv,
                            backend.plan(AttentionBatch([L - n], [L - n], [pages], 0)))
    T = sum(q_lens)
    q, k, v = torch.randn(T, HQ, D), torch.randn(T, hkv, D), torch.randn(T, hkv, D)
    meta = backend.plan(AttentionBatch(q_lens, kv_lens, page_ids, sum(1 for n in q_lens if n == 1)))
    out = backend.forward(0, q, k, None if latent else v, meta)
    keys, values, row = [], [], 0
    for n, (hk, hv) in zip(q_lens, hist):
        kk = torch.cat([hk, k[row:row + n]])
        keys.append(kk)
        values.append(kk[..., :D // 2] if latent else torch.cat([hv, v[row:row + n]]))
        row += n
    return out, q, keys, values, meta


@pytest.mark.parametrize("layout", ["HND", "NHD"])
@pytest.mark.parametrize("window", [None, 6])
def test_one_sequence_verifying_drafts_is_exact_and_batched(monkeypatch, layout, window):
    torch.manual_seed(1)
    kv = KVCache(1, 16, P, HKV, D, torch.float32, layout, "cpu")
    backend = TorchAttentionBackend(kv, HQ, HKV, D, D ** -0.5, sliding_window=window)
    calls = []
    real = F.scaled_dot_product_attention

    def spy(*args, **kw):
        calls.append(tuple(args[0].shape))
        return real(*args, **kw)

    hist = [(torch.randn(13, HKV, D), torch.randn(13, HKV, D))]
    pages = [[5, 2, 9, 0, 11]]
    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    out, q, keys, values, meta = _step(backend, [5], [18], pages, hist)
    assert meta.num_decodes == 1 and meta.decode_tokens == 5 and not meta.prefills
    assert calls[-1] == (1, HQ, 5, D), calls  # one fused call with the 5 rows, not a per-row loop
    torch.testing.assert_close(out.double(), _reference(q, keys[0], values[0], 18, 5, window),
                               atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("layout", ["HND", "NHD"])
@pytest.mark.parametrize("window", [None, 5])
def test_decodes_and_verifications_of_different_lengths_share_one_batch(layout, window):
    torch.manual_seed(2)
    kv = KVCache(1, 40, P, HKV, D, torch.float32, layout, "cpu")
    backend = TorchAttentionBackend(kv, HQ, HKV, D, D ** -0.5, sliding_window=window)
    # Two decodes, verifications of 2, 5 and 3 rows (ngram drafts fewer when it finds less),
    # then a first prefill chunk and a chunk too long for the batched path.
    q_lens = [1, 1, 2, 5, 3, 6, MULTI_QUERY_MAX + 1]
    kv_lens = [9, 3, 11, 7, 16, 6, MULTI_QUERY_MAX + 8]
    free = list(range(39, -1, -1))
    page_ids = [[free.pop() for _ in range(-(-n // P))] for n in kv_lens]
    hist = [(torch.randn(L - n, HKV, D), torch.randn(L - n, HKV, D)) for n, L in zip(q_lens, kv_lens)]
    out, q, keys, values, meta = _step(backend, q_lens, kv_lens, page_ids, hist)
    assert meta.num_decodes == 5 and meta.decode_tokens == 12 and meta.decode_q == 5
    assert [p.end - p.start for p in meta.prefills] == [6, MULTI_QUERY_MAX + 1]
    row = 0
    for n, L, kk, vv in zip(q_lens, kv_lens, keys, values):
        torch.testing.assert_close(out[row:row + n].double(), _reference(q[row:row + n], kk, vv, L, n, window),
                                   atol=1e-5, rtol=1e-5)
        row += n


def test_latent_cache_verification_reads_the_latent_as_key_and_value():
    torch.manual_seed(3)
    kv = KVCache(1, 16, P, 1, D, torch.float32, "HND", "cpu", kv_parts=1)
    backend = TorchAttentionBackend(kv, HQ, 1, D, D ** -0.5, value_dim=D // 2)
    q_lens, kv_lens, page_ids = [1, 4], [6, 10], [[3, 4], [7, 8, 9]]
    hist = [(torch.randn(L - n, 1, D), None) for n, L in zip(q_lens, kv_lens)]
    out, q, keys, values, meta = _step(backend, q_lens, kv_lens, page_ids, hist, latent=True)
    assert meta.num_decodes == 2 and fresh_is_none(backend, meta)
    torch.testing.assert_close(out[1:].double(), _reference(q[1:], keys[1], values[1], 10, 4), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out[:1].double(), _reference(q[:1], keys[0], values[0], 6, 1), atol=1e-5, rtol=1e-5)


def fresh_is_none(backend, meta) -> bool:
    """MLA attends decompressed only when every sequence's keys are its new tokens."""
    return backend.fresh_prefill_spans(meta) is None


@pytest.mark.parametrize("window", [None, 7])
def test_one_sequence_mask_stays_right_aligned_as_its_cached_buffer_grows(window):
    """The batch-1 mask is a view of a cached right-aligned buffer (256 keys wide at first): a
    sequence longer than it regrows the buffer, and a shorter one after that still gets its own
    causal limits."""
    torch.manual_seed(4)
    kv = KVCache(1, 160, P, HKV, D, torch.float32, "HND", "cpu")
    backend = TorchAttentionBackend(kv, HQ, HKV, D, D ** -0.5, sliding_window=window)
    free = list(range(159, -1, -1))
    for kv_len, n in ((18, 4), (300, 2), (21, 5)):  # one buffer serves every row count
        pages = [[free.pop() for _ in range(-(-kv_len // P))]]
        hist = [(torch.randn(kv_len - n, HKV, D), torch.randn(kv_len - n, HKV, D))]
        out, q, keys, values, _ = _step(backend, [n], [kv_len], pages, hist)
        torch.testing.assert_close(out.double(), _reference(q, keys[0], values[0], kv_len, n, window),
                                   atol=1e-5, rtol=1e-5)
        free.extend(pages[0])
