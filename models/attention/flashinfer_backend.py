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

No device-to-host sync per step: ``plan()`` reads ``indptr`` and ``last_page_len`` on the host
(``.to("cpu")``) to split the work. If they lived on the GPU that would be a D2H copy and a
stream sync every step, so :func:`build_paged_kv_meta` builds all of the step's metadata on the
CPU, in pinned memory on a GPU, and ``plan()`` / the write indices copy it to the device with
``non_blocking=True`` (torch's pinned-memory allocator keeps each buffer alive until its copy has
run). FlashInfer compiles kernels for head_dim in :data:`FLASHINFER_HEAD_DIMS` only; other sizes
are refused when the backend is built, before any memory is allocated.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pdkv.models.attention import fp8_kv, register
from pdkv.models.attention.base import AttentionBackend, AttentionBatch, GraphDecodeState, page_table, write_slots
from pdkv.errors import BackendUnavailable

WORKSPACE_BYTES = 128 * 1024 * 1024
FLASHINFER_HEAD_DIMS = (64, 128, 256, 512)  # what FlashInfer's paged prefill/decode dispatch


def check_head_dim(head_dim: int) -> None:
    if head_dim not in FLASHINFER_HEAD_DIMS:
        raise BackendUnavailable(
            f"model.attention_backend='flashinfer': the model's head_dim is {head_dim}, but FlashInfer's "
            f"paged attention kernels exist for head_dim {', '.join(map(str, FLASHINFER_HEAD_DIMS))} only; "
            "use attention_backend='torch' for this model")


@dataclass(frozen=True)
class PagedKVMeta:
    """One step's FlashInfer metadata, built on the host (see the module docstring).

    Sequence i's keys are its first kv_len[i] tokens, in pages
    paged_kv_indices[paged_kv_indptr[i]:paged_kv_indptr[i+1]], the last of which holds
    paged_kv_last_page_len[i] (1..P) of them; its queries are rows qo_indptr[i]:qo_indptr[i+1].
    """

    qo_indptr: torch.Tensor  # [B + 1] int32
    paged_kv_indptr: torch.Tensor  # [B + 1] int32
    paged_kv_indices: torch.Tensor  # [nnz_pages] int32
    paged_kv_last_page_len: torch.Tensor  # [B] int32
    write_pages: torch.Tensor  # [T] int64: page of each new token (same as the torch backend's)
    write_offsets: torch.Tensor  # [T] int64: its slot in that page


def build_paged_kv_meta(batch: AttentionBatch, page_size: int, pin: bool = False) -> PagedKVMeta:
    """The CSR page table of ``batch`` on the CPU (in pinned memory when ``pin``)."""
    P = page_size
    indptr, indices, last_len, qo_indptr = [0], [], [], [0]
    for q_len, kv_len, pages in zip(batch.q_lens, batch.kv_lens, batch.page_ids):
        n = (kv_len + P - 1) // P  # pages holding keys; pages reserved beyond them are not read
        if not 0 < q_len <= kv_len or n > len(pages):
            raise ValueError(f"attention batch: a sequence with q_len {q_len}, kv_len {kv_len} and "
                             f"{len(pages)} page(s) of {P} tokens cannot be planned")
        indices.extend(pages[:n])
        indptr.append(indptr[-1] + n)
        last_len.append(kv_len - (n - 1) * P)
        qo_indptr.append(qo_indptr[-1] + q_len)
    write_pages, write_offsets = write_slots(batch, page_table(batch.page_ids, "cpu"), P)

    def host(x, dtype=torch.int32):
        t = x.to(dtype) if isinstance(x, torch.Tensor) else torch.tensor(x, dtype=dtype)
        return t.pin_memory() if pin else t

    return PagedKVMeta(host(qo_indptr), host(indptr), host(indices), host(last_len),
                       host(write_pages, torch.long), host(write_offsets, torch.long))


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
    def check_available(cls, device, dtype, head_dim: int | None = None) -> None:
        if head_dim is not None:  # known from config.json before the weights load
            check_head_dim(head_dim)
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
        check_head_dim(head_dim)
        if value_dim is not None and value_dim != head_dim:
            raise ValueError(f"the flashinfer backend serves K/V caches only, not an MLA latent "
                             f"(value_dim {value_dim} != head_dim {head_dim}): use attention_backend: torch")
        # An FP8 cache (models/attention/fp8_kv.py): FlashInfer's fp8-KV kernels take bf16 / fp16
        # queries and the per-tensor scales at run(); the engine sets q_dtype to the model's.
        self.fp8 = fp8_kv.is_fp8(kv_cache.dtype)
        self.q_dtype = torch.bfloat16 if self.fp8 else kv_cache.dtype
        self.check_available(kv_cache.device, self.q_dtype)
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
        m = build_paged_kv_meta(batch, P, pin=True)
        common = dict(pos_encoding_mode="NONE", window_left=self._window_left, sm_scale=self.scale,
                      q_data_type=self.q_dtype, kv_data_type=self.kv.dtype, non_blocking=True)
        if batch.num_decodes == len(batch.q_lens):
            self._decode.plan(m.paged_kv_indptr, m.paged_kv_indices, m.paged_kv_last_page_len,
                              self.num_heads, self.num_kv_heads, self.head_dim, P, **common)
            wrapper = self._decode
        else:
            self._prefill.plan(m.qo_indptr, m.paged_kv_indptr, m.paged_kv_indices,
                               m.paged_kv_last_page_len, self.num_heads, self.num_kv_heads,
                               self.head_dim, P, causal=True, **common)
            wrapper = self._prefill
        return FlashInferMeta(m.write_pages.to(dev, non_blocking=True),
                              m.write_offsets.to(dev, non_blocking=True), wrapper)

    def graph_decode(self, max_batch: int, max_pages: int, batch_sizes: tuple[int, ...]) -> "FlashInferGraphDecode":
        return FlashInferGraphDecode(self, max_pages, batch_sizes)

    def forward(self, layer, q, k, v, meta: FlashInferMeta) -> torch.Tensor:
        cache = self.kv.layer(layer)
        if self.fp8:
            ks, vs = self.kv.kv_scales[layer]
            k, v = fp8_kv.quantize(k, ks), fp8_kv.quantize(v, vs)
        if self.kv.layout == "HND":
            cache[meta.write_pages, 0, :, meta.write_offsets] = k
            cache[meta.write_pages, 1, :, meta.write_offsets] = v
        else:
            cache[meta.write_pages, 0, meta.write_offsets] = k
            cache[meta.write_pages, 1, meta.write_offsets] = v
        if self.fp8:
            ks, vs = self.kv.kv_scales[layer]
            out = meta.wrapper.run(q.contiguous(), cache, k_scale=ks, v_scale=vs)
        else:
            out = meta.wrapper.run(q.contiguous(), cache)  # [T, Hq, D]
        return out.reshape(q.shape[0], -1)


class FlashInferGraphDecode(GraphDecodeState):
    """Decode steps under CUDA graphs: one ``BatchDecodeWithPagedKVCacheWrapper(use_cuda_graph=True)``
    per captured batch size, all over the same fixed CSR buffers (FlashInfer fixes a graph
    wrapper's batch size at construction; ``plan`` copies a step's host metadata into the
    buffers and must run outside the graph, before each replay):

      indptr   [max_batch + 1]          int32  (each wrapper sees [:bs + 1])
      indices  [max_batch * max_pages]  int32  only the pages holding keys, packed
      last_len [max_batch]              int32  (each wrapper sees [:bs])

    The float workspace is the backend's, shared with its eager wrappers (steps never overlap)."""

    def __init__(self, backend: FlashInferBackend, max_pages: int, batch_sizes: tuple[int, ...]):
        fi = _import_flashinfer()
        dev, max_batch = torch.device(backend.kv.device), max(batch_sizes)
        self.backend = backend
        self.widths = (max_pages,)  # it reads only the pages in use: one width, the widest
        self.indptr = torch.zeros(max_batch + 1, dtype=torch.int32, device=dev)
        self.indices = torch.zeros(max_batch * max_pages, dtype=torch.int32, device=dev)
        self.last_len = torch.ones(max_batch, dtype=torch.int32, device=dev)
        tensor_cores = backend.num_heads // backend.num_kv_heads >= 4  # as the eager decode wrapper
        self.wrappers = {
            bs: fi.BatchDecodeWithPagedKVCacheWrapper(
                backend._workspace, kv_layout=backend.kv.layout, use_cuda_graph=True, use_tensor_cores=tensor_cores,
                paged_kv_indptr_buffer=self.indptr[:bs + 1], paged_kv_indices_buffer=self.indices,
                paged_kv_last_page_len_buffer=self.last_len[:bs])
            for bs in batch_sizes}

    def update(self, batch: AttentionBatch, fill_page: int, width: int) -> None:
        b, P = self.backend, self.backend.kv.page_size
        m = build_paged_kv_meta(batch, P, pin=True)
        self.wrappers[len(batch.kv_lens)].plan(
            m.paged_kv_indptr, m.paged_kv_indices, m.paged_kv_last_page_len, b.num_heads, b.num_kv_heads,
            b.head_dim, P, pos_encoding_mode="NONE", window_left=b._window_left, sm_scale=b.scale,
            q_data_type=b.q_dtype, kv_data_type=b.kv.dtype, non_blocking=True)

    def meta(self, bs: int, width: int, write_pages: torch.Tensor, write_offsets: torch.Tensor) -> FlashInferMeta:
        return FlashInferMeta(write_pages, write_offsets, self.wrappers[bs])
