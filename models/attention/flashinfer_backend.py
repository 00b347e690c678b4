"""FlashInfer paged attention (GPU only).

``flashinfer`` is imported when this backend is built, never when the module is imported, and
building it where it cannot run (package missing, no CUDA device, the cache on the CPU) raises
BackendUnavailable with the reason. Steps with prefill chunks use
BatchPrefillWithPagedKVCacheWrapper (its causal mask is aligned to the end of each sequence's
keys, which is what a chunk after earlier chunks needs); steps of decodes only use
BatchDecodeWithPagedKVCacheWrapper. Both read the cache in our layout (``kv_layout`` = HND or NHD,
one [num_pages, 2, ...] tensor per layer) through the CSR page table:

  paged_kv_indptr        [B + 1]  int32   sequence i's pages are indices[indptr[i]:indptr[i+1]]
  paged_kv_indices       [nnz_pages] int32
  paged_kv_last_page_len [B]      int32   tokens in each sequence's last page (1..P)
  qo_indptr              [B + 1]  int32   (prefill) query tokens of sequence i

New K/V are written with the same index_put as the torch backend (it runs on the GPU too).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from models.attention import register
from models.attention.base import AttentionBackend, AttentionBatch, page_table, write_slots
from pdkv.errors import BackendUnavailable

WORKSPACE_BYTES = 128 * 1024 * 1024


def _import_flashinfer():
    try:
        import flashinfer  # noqa: PLC0415 - GPU-only dependency, imported only when chosen
    except ImportError as e:
        raise BackendUnavailable(
            "model.attention_backend='flashinfer' but the flashinfer package cannot be imported "
            f"({e}); install flashinfer for your CUDA/torch build or use attention_backend='torch'"
        ) from e
    return flashinfer


@dataclass
class FlashInferMeta:
    write_pages: torch.Tensor  # [T] long
    write_offsets: torch.Tensor  # [T] long
    wrapper: object  # the planned prefill or decode wrapper


@register("flashinfer")
class FlashInferBackend(AttentionBackend):
    @classmethod
    def check_available(cls, device, dtype) -> None:
        device = torch.device(device)
        if device.type != "cuda":
            raise BackendUnavailable(
                f"model.attention_backend='flashinfer' needs a CUDA device, but model.device is "
                f"{str(device)!r}; set model.device='cuda' or use attention_backend='torch'")
        if not torch.cuda.is_available():
            raise BackendUnavailable("model.attention_backend='flashinfer': torch sees no CUDA device")
        if dtype not in (torch.float16, torch.bfloat16):
            raise BackendUnavailable(f"model.attention_backend='flashinfer' needs model.dtype float16 or "
                                     f"bfloat16, got {dtype}")
        _import_flashinfer()

    def __init__(self, kv_cache, num_heads, num_kv_heads, head_dim, scale, sliding_window=None, value_dim=None):
        super().__init__(kv_cache, num_heads, num_kv_heads, head_dim, scale, sliding_window, value_dim)
        self.check_available(kv_cache.device, kv_cache.dtype)
        fi = _import_flashinfer()
        device = torch.device(kv_cache.device)
        self._workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        layout = kv_cache.layout
        self._prefill = fi.BatchPrefillWithPagedKVCacheWrapper(self._workspace, kv_layout=layout)
        self._decode = fi.BatchDecodeWithPagedKVCacheWrapper(
            self._workspace, kv_layout=layout, use_tensor_cores=num_heads // num_kv_heads >= 4)
        self._window_left = (sliding_window - 1) if sliding_window else -1

    def plan(self, batch: AttentionBatch) -> FlashInferMeta:
        P, dev = self.kv.page_size, self.kv.device
        indptr, indices, last_len, qo_indptr = [0], [], [], [0]
        for q_len, kv_len, pages in zip(batch.q_lens, batch.kv_lens, batch.page_ids):
            n = (kv_len + P - 1) // P
            indices.extend(pages[:n])
            indptr.append(indptr[-1] + n)
            last_len.append(kv_len - (n - 1) * P)
            qo_indptr.append(qo_indptr[-1] + q_len)
        write_pages, write_offsets = write_slots(batch, page_table(batch.page_ids, dev), P)

        def i32(x):
            return torch.tensor(x, dtype=torch.int32, device=dev)

        dtype = self.kv.dtype
        if batch.num_decodes == len(batch.q_lens):
            self._decode.plan(i32(indptr), i32(indices), i32(last_len), self.num_heads,
                              self.num_kv_heads, self.head_dim, P, pos_encoding_mode="NONE",
                              window_left=self._window_left, sm_scale=self.scale,
                              q_data_type=dtype, kv_data_type=dtype)
            wrapper = self._decode
        else:
            self._prefill.plan(i32(qo_indptr), i32(indptr), i32(indices), i32(last_len),
                               self.num_heads, self.num_kv_heads, self.head_dim, P, causal=True,
                               pos_encoding_mode="NONE", window_left=self._window_left,
                               sm_scale=self.scale, q_data_type=dtype, kv_data_type=dtype)
            wrapper = self._prefill
        return FlashInferMeta(write_pages, write_offsets, wrapper)

    def forward(self, layer, q, k, v, meta: FlashInferMeta) -> torch.Tensor:
        cache = self.kv.layer(layer)
        if self.kv.layout == "HND":
            cache[meta.write_pages, 0, :, meta.write_offsets] = k
            cache[meta.write_pages, 1, :, meta.write_offsets] = v
        else:
            cache[meta.write_pages, 0, meta.write_offsets] = k
            cache[meta.write_pages, 1, meta.write_offsets] = v
        out = meta.wrapper.run(q.contiguous(), cache)  # [T, Hq, D]
        return out.reshape(q.shape[0], -1)
