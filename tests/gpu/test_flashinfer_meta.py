"""FlashInfer's planning metadata, built on the CPU, describes exactly the keys the torch backend
attends to.

FlashInfer itself needs a GPU, so the check here is on the metadata's meaning: a reference
paged attention that reads the cache only through FlashInfer's CSR page table (indptr, indices,
last_page_len, qo_indptr, causal mask aligned to the end of each sequence's keys, window_left), as
FlashInfer's docs define it, must give the torch backend's output on the same cache, and the new
tokens' write slots must be the torch backend's. tools/gpu_check.py runs FlashInfer itself
against the torch backend on a GPU.
"""

from __future__ import annotations

import random

import pytest
import torch

from pdkv.models.attention.base import AttentionBatch
from pdkv.models.attention.flashinfer_backend import (FLASHINFER_HEAD_DIMS, FlashInferBackend, PagedKVMeta,
                                                 build_paged_kv_meta, check_head_dim)
from pdkv.models.attention.torch_backend import TorchAttentionBackend
from pdkv.errors import BackendUnavailable
from pdkv.kv.cache import KVCache


def reference_attention(q, cache, layout: str, m: PagedKVMeta, page_size: int, scale: float,
                        window_left: int) -> torch.Tensor:
    """What FlashInfer computes, read through its metadata only. q: [T, Hq, D] -> [T, Hq * D]."""
    T, Hq, D = q.shape
    out = torch.empty(T, Hq * D, dtype=torch.float32)
    for i in range(len(m.paged_kv_last_page_len)):
        pages = m.paged_kv_indices[m.paged_kv_indptr[i]:m.paged_kv_indptr[i + 1]].long()
        kv_len = (len(pages) - 1) * page_size + int(m.paged_kv_last_page_len[i])
        kv = cache[pages]  # [n, 2, H, P, D] (HND) or [n, 2, P, H, D] (NHD)
        if layout == "HND":
            kv = kv.permute(1, 0, 3, 2, 4)  # [2, n, P, H, D]
        else:
            kv = kv.transpose(0, 1)
        keys = kv[0].reshape(-1, kv.shape[-2], D)[:kv_len].float()  # [L, H, D]
        values = kv[1].reshape(-1, kv.shape[-2], D)[:kv_len].float()
        lo, hi = int(m.qo_indptr[i]), int(m.qo_indptr[i + 1])
        group = Hq // keys.shape[1]
        keys, values = keys.repeat_interleave(group, 1), values.repeat_interleave(group, 1)
        qi = q[lo:hi].float()  # [n_q, Hq, D]
        scores = torch.einsum("qhd,khd->hqk", qi, keys) * scale
        q_pos = torch.arange(kv_len - (hi - lo), kv_len)[:, None]  # causal, aligned to the end
        k_pos = torch.arange(kv_len)[None, :]
        allowed = k_pos <= q_pos
        if window_left >= 0:
            allowed &= k_pos >= q_pos - window_left
        scores = scores.masked_fill(~allowed, float("-inf"))
        out[lo:hi] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), values).reshape(hi - lo, -1)
    return out


def _random_batch(rng: random.Random, page_size: int, num_pages: int, with_prefill: bool) -> AttentionBatch:
    free = list(range(num_pages))
    rng.shuffle(free)
    q_lens, kv_lens, page_ids = [], [], []
    num_decodes = rng.randint(1, 4)
    for s in range(num_decodes + (rng.randint(1, 3) if with_prefill else 0)):
        kv_len = rng.randint(1, 5 * page_size)
        q_len = 1 if s < num_decodes else rng.randint(1, kv_len)
        n = -(-kv_len // page_size) + rng.randint(0, 2)  # some sequences hold spare pages
        page_ids.append([free.pop() for _ in range(n)])
        q_lens.append(q_len)
        kv_lens.append(kv_len)
    return AttentionBatch(q_lens, kv_lens, page_ids, num_decodes if with_prefill else len(q_lens))


@pytest.mark.parametrize("layout", ["HND", "NHD"])
@pytest.mark.parametrize("with_prefill", [False, True])
@pytest.mark.parametrize("window", [None, 5])
def test_flashinfer_metadata_reads_what_the_torch_backend_attends_to(layout, with_prefill, window):
    rng = random.Random(hash((layout, with_prefill, window)) & 0xFFFF)
    torch.manual_seed(rng.randint(0, 1 << 30))
    P, Hq, Hkv, D, num_pages = 4, 4, 2, 8, 64
    for _ in range(4):
        batch = _random_batch(rng, P, num_pages, with_prefill)
        cache = KVCache(1, num_pages, P, Hkv, D, torch.float32, layout)
        cache.layer(0).copy_(torch.randn_like(cache.layer(0)))
        backend = TorchAttentionBackend(cache, Hq, Hkv, D, D ** -0.5, window)
        T = batch.num_tokens
        q, k, v = torch.randn(T, Hq, D), torch.randn(T, Hkv, D), torch.randn(T, Hkv, D)
        tmeta = backend.plan(batch)
        want = backend.forward(0, q, k, v, tmeta)  # writes k/v into the cache, then attends

        m = build_paged_kv_meta(batch, P)
        for t in (m.qo_indptr, m.paged_kv_indptr, m.paged_kv_indices, m.paged_kv_last_page_len):
            assert t.device.type == "cpu" and t.dtype == torch.int32
        assert torch.equal(m.write_pages, tmeta.write_pages) and torch.equal(m.write_offsets, tmeta.write_offsets)
        got = reference_attention(q, cache.layer(0), layout, m, P, D ** -0.5, (window - 1) if window else -1)
        torch.testing.assert_close(got, want.float(), rtol=1e-4, atol=1e-5)


def test_metadata_of_a_hand_made_batch():
    # seq 0: 9 tokens in pages [7, 3, 5] of 4 (+ a spare page 8); seq 1: 4 tokens in [2]
    batch = AttentionBatch(q_lens=[1, 3], kv_lens=[9, 4], page_ids=[[7, 3, 5, 8], [2]], num_decodes=1)
    m = build_paged_kv_meta(batch, 4)
    assert m.qo_indptr.tolist() == [0, 1, 4]
    assert m.paged_kv_indptr.tolist() == [0, 3, 4]
    assert m.paged_kv_indices.tolist() == [7, 3, 5, 2]  # the spare page 8 is not read
    assert m.paged_kv_last_page_len.tolist() == [1, 4]
    assert m.write_pages.tolist() == [5, 2, 2, 2] and m.write_offsets.tolist() == [0, 1, 2, 3]


def test_a_batch_that_cannot_be_planned_is_refused():
    with pytest.raises(ValueError, match="q_len 1, kv_len 9 and 2 page"):
        build_paged_kv_meta(AttentionBatch([1], [9], [[1, 2]], 1), 4)


@pytest.mark.parametrize("head_dim", [32, 80, 96, 160, 192])
def test_head_dims_flashinfer_does_not_dispatch_are_refused_naming_them(head_dim):
    msg = (f"the model's head_dim is {head_dim}, but FlashInfer's paged attention kernels exist for "
           "head_dim 64, 128, 256, 512 only; use attention_backend='torch'")
    with pytest.raises(BackendUnavailable, match=msg):
        check_head_dim(head_dim)
    with pytest.raises(BackendUnavailable, match=msg):
        FlashInferBackend.check_available("cuda", torch.bfloat16, head_dim=head_dim)
    cache = KVCache(1, 4, 4, 1, head_dim, torch.bfloat16)
    with pytest.raises(BackendUnavailable, match=msg):  # before it looks for a GPU
        FlashInferBackend(cache, 2, 1, head_dim, 1.0)


def test_supported_head_dims_pass_the_check_and_then_need_a_gpu():
    for head_dim in FLASHINFER_HEAD_DIMS:
        check_head_dim(head_dim)
    cache = KVCache(1, 4, 4, 1, 64, torch.bfloat16)
    with pytest.raises(BackendUnavailable, match="needs a CUDA device, but model.device is 'cpu'"):
        FlashInferBackend(cache, 2, 1, 64, 1.0)


# ---- the backend's calls into FlashInfer, against a recording stand-in with 0.6.18's signatures ----

class RecordingFlashInfer:
    """Fault-injection stand-in for the ``flashinfer`` module: wrappers with FlashInfer 0.6.18's
    constructor/plan/run signatures (a wrong call is a TypeError here too) that record what
    they were given and compute attention from the planned metadata with reference_attention."""

    def __init__(self, page_size: int):
        self.calls: list[tuple[str, dict]] = []
        rec, P = self, page_size

        class _Wrapper:
            def _planned(self, kind, meta, kw):
                rec.calls.append((kind, {**kw, "meta": meta}))
                self.meta, self.kw = meta, kw

            def run(self, q, paged_kv_cache, *args, q_scale=None, k_scale=None, v_scale=None, out=None,
                    lse=None, return_lse=False, enable_pdl=None, window_left=None, sinks=None, **rest):
                rec.calls.append(("run", {"q": q, "cache": paged_kv_cache}))
                return reference_attention(q, paged_kv_cache, self.layout, self.meta, P, self.kw["sm_scale"],
                                           self.kw["window_left"]).view(q.shape).to(q.dtype)

        class BatchDecodeWithPagedKVCacheWrapper(_Wrapper):
            def __init__(self, float_workspace_buffer, kv_layout="NHD", use_cuda_graph=False, use_tensor_cores=False,
                         paged_kv_indptr_buffer=None, paged_kv_indices_buffer=None,
                         paged_kv_last_page_len_buffer=None, backend="auto", jit_args=None):
                self.layout = kv_layout

            def plan(self, indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim, page_size, *,
                     pos_encoding_mode="NONE", window_left=-1, window_right=0, logits_soft_cap=None,
                     q_data_type="float16", kv_data_type=None, o_data_type=None, data_type=None, sm_scale=None,
                     rope_scale=None, rope_theta=None, non_blocking=True, block_tables=None, seq_lens=None,
                     fixed_split_size=None, disable_split_kv=False, q_len_per_req=1):
                qo = torch.arange(len(last_page_len) + 1, dtype=torch.int32)
                self._planned("decode", PagedKVMeta(qo, indptr, indices, last_page_len, None, None),
                              dict(window_left=window_left, sm_scale=sm_scale, non_blocking=non_blocking,
                                   q_data_type=q_data_type, kv_data_type=kv_data_type, heads=(num_qo_heads, num_kv_heads),
                                   head_dim=head_dim, page_size=page_size, pos_encoding_mode=pos_encoding_mode))

        class BatchPrefillWithPagedKVCacheWrapper(_Wrapper):
            def __init__(self, float_workspace_buffer, kv_layout="NHD", use_cuda_graph=False, qo_indptr_buf=None,
                         paged_kv_indptr_buf=None, paged_kv_indices_buf=None, paged_kv_last_page_len_buf=None,
                         custom_mask_buf=None, mask_indptr_buf=None, backend="auto", jit_args=None, jit_kwargs=None):
                self.layout = kv_layout

            def plan(self, qo_indptr, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len, num_qo_heads,
                     num_kv_heads, head_dim_qk, page_size, head_dim_vo=None, custom_mask=None,
                     packed_custom_mask=None, causal=False, pos_encoding_mode="NONE", use_fp16_qk_reduction=False,
                     sm_scale=None, window_left=-1, logits_soft_cap=None, rope_scale=None, rope_theta=None,
                     q_data_type="float16", kv_data_type=None, o_data_type=None, non_blocking=True, **rest):
                assert causal, "prefill chunks need the causal mask"
                self._planned("prefill", PagedKVMeta(qo_indptr, paged_kv_indptr, paged_kv_indices,
                                                     paged_kv_last_page_len, None, None),
                              dict(window_left=window_left, sm_scale=sm_scale, non_blocking=non_blocking,
                                   q_data_type=q_data_type, kv_data_type=kv_data_type,
                                   heads=(num_qo_heads, num_kv_heads), head_dim=head_dim_qk, page_size=page_size,
                                   pos_encoding_mode=pos_encoding_mode))

        self.BatchDecodeWithPagedKVCacheWrapper = BatchDecodeWithPagedKVCacheWrapper
        self.BatchPrefillWithPagedKVCacheWrapper = BatchPrefillWithPagedKVCacheWrapper


@pytest.mark.parametrize("layout", ["HND", "NHD"])
def test_the_backend_plans_flashinfer_with_host_metadata_and_matches_torch(monkeypatch, layout):
    import sys

    P, Hq, Hkv, D, num_pages, window = 4, 8, 2, 64, 64, 7
    fake = RecordingFlashInfer(P)
    monkeypatch.setitem(sys.modules, "flashinfer", fake)
    monkeypatch.setattr(FlashInferBackend, "check_available", classmethod(lambda cls, *a, **k: None))  # no GPU here

    def pin(t):  # stands in for pinning (needs CUDA): marks the tensor so the test can see it
        t = t.clone()
        t.pdkv_pinned = True
        return t

    monkeypatch.setattr(torch.Tensor, "pin_memory", pin)
    rng = random.Random(11)
    torch.manual_seed(11)
    for with_prefill in (False, True, True):
        batch = _random_batch(rng, P, num_pages, with_prefill)
        caches = [KVCache(1, num_pages, P, Hkv, D, torch.float32, layout) for _ in range(2)]
        caches[0].layer(0).normal_()
        caches[1].layer(0).copy_(caches[0].layer(0))
        ref = TorchAttentionBackend(caches[0], Hq, Hkv, D, 0.125, window)
        fib = FlashInferBackend(caches[1], Hq, Hkv, D, 0.125, window)
        T = batch.num_tokens
        q, k, v = torch.randn(T, Hq, D), torch.randn(T, Hkv, D), torch.randn(T, Hkv, D)
        want = ref.forward(0, q, k, v, ref.plan(batch))
        fake.calls.clear()
        got = fib.forward(0, q, k, v, fib.plan(batch))
        (kind, planned), (run, ran) = fake.calls
        assert kind == ("prefill" if with_prefill else "decode") and run == "run"
        m = planned["meta"]
        tensors = [m.paged_kv_indptr, m.paged_kv_indices, m.paged_kv_last_page_len] + ([m.qo_indptr] if with_prefill else [])
        for t in tensors:  # on the host, pinned, int32: plan() reads them without a device sync
            assert t.device.type == "cpu" and t.dtype == torch.int32 and getattr(t, "pdkv_pinned", False)
        assert planned["non_blocking"] is True and planned["pos_encoding_mode"] == "NONE"
        assert planned["window_left"] == window - 1 and planned["sm_scale"] == 0.125
        assert planned["q_data_type"] == planned["kv_data_type"] == torch.float32
        assert planned["heads"] == (Hq, Hkv) and planned["head_dim"] == D and planned["page_size"] == P
        assert ran["cache"] is caches[1].layer(0) and ran["q"].is_contiguous()
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
        assert torch.equal(caches[0].layer(0), caches[1].layer(0))  # the same K/V writes
