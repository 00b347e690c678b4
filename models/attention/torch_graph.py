"""The torch backend's decode metadata for CUDA graphs: a fixed page table and lengths.

A captured decode step attends through the batched path of the torch backend
(``TorchAttentionBackend._decode``) at a fixed shape: ``bs`` rows over a page table of
``max_pages`` columns (every request's whole possible context, ``ceil(max_model_len / P)``), the
keys a row must not see masked by its length. The table, the lengths and the mask live in
buffers that never move:

  table    [max_batch, max_pages] long  row b's pages, then ``fill_page`` to the width
  kv_lens  [max_batch]            long  keys row b sees (its new token included)
  blocked  [max_batch, 1, L]      bool  (L = max_pages * P) True: key j is masked for row b

``update`` (outside the graph) copies the step's table and lengths in with one host-to-device
copy; ``meta`` (inside the graph) recomputes ``blocked`` from ``kv_lens`` in place, so a replay
masks by the step's lengths. NOTE: the gather reads every column, so a graph step costs as much
attention as a request at ``max_model_len``; FlashInfer's graph decode reads only the pages in
use (flashinfer_backend.FlashInferGraphDecode). Keep ``model.max_model_len`` to what is served.
"""

from __future__ import annotations

import torch

from models.attention.base import AttentionBatch, GraphDecodeState


class TorchGraphDecode(GraphDecodeState):
    def __init__(self, backend, max_batch: int, max_pages: int):
        from models.attention.torch_backend import TorchAttentionMeta  # noqa: PLC0415 - no import cycle

        self._meta_cls = TorchAttentionMeta
        P, dev = backend.kv.page_size, backend.kv.device
        self.max_batch, self.max_pages, self.window, self.page_size = max_batch, max_pages, backend.sliding_window, P
        # [max_batch, 1 + max_pages]: column 0 the length, then the page table (one copy per step)
        self._buf = torch.zeros(max_batch, 1 + max_pages, dtype=torch.long, device=dev)
        self.kv_lens, self.table = self._buf[:, 0], self._buf[:, 1:]
        self._keys = torch.arange(max_pages * P, device=dev)  # [L] key positions
        self.blocked = torch.ones(max_batch, 1, max_pages * P, dtype=torch.bool, device=dev)
        self._pin = torch.device(dev).type == "cuda"

    def update(self, batch: AttentionBatch, fill_page: int) -> None:
        bs, W = len(batch.kv_lens), self.max_pages
        if bs > self.max_batch:
            raise ValueError(f"a graph step of {bs} rows, but the buffers hold {self.max_batch}")
        rows = []
        for kv_len, pages in zip(batch.kv_lens, batch.page_ids):
            n = -(-kv_len // self.page_size)  # pages holding keys
            if n > W:
                raise ValueError(f"a graph step row of {kv_len} keys needs {n} pages, the table holds {W}")
            rows.append([kv_len, *pages[:n]] + [fill_page] * (W - n))
        host = torch.tensor(rows, dtype=torch.long)
        self._buf[:bs].copy_(host.pin_memory() if self._pin else host, non_blocking=self._pin)

    def meta(self, bs: int, write_pages: torch.Tensor, write_offsets: torch.Tensor):
        """Inside the captured function: only tensor ops on the static buffers."""
        blocked, keys, lens = self.blocked[:bs], self._keys.view(1, 1, -1), self.kv_lens[:bs].view(bs, 1, 1)
        torch.ge(keys, lens, out=blocked)  # key j is beyond row b's kv_len
        if self.window is not None:  # row b sits at kv_len - 1 and sees the window before it
            blocked.logical_or_(keys <= lens - 1 - self.window)
        return self._meta_cls(
            write_pages=write_pages, write_offsets=write_offsets, num_decodes=bs, decode_tokens=bs, decode_q=1,
            decode_pages=self.table[:bs].reshape(-1), decode_blocked=blocked, decode_masked=False, decode_kv_len=0,
            pad_rows=None, unpad_rows=None, prefills=[])
