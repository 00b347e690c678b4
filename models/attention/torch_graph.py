"""The torch backend's decode metadata for CUDA graphs: a fixed page table and lengths.

A captured decode step attends through the batched path of the torch backend
(``TorchAttentionBackend._decode``) at a fixed shape: ``bs`` rows over the first ``width``
columns of a page table, the keys a row must not see masked by its length. The gather reads every
one of those columns, so one width for every context would make each step cost a full
``max_model_len`` of attention: graphs are captured per width instead, powers of two from
``MIN_WIDTH`` pages up to ``max_pages`` (``ceil(max_model_len / P)``), and a step takes the
narrowest that holds its longest row. The buffers never move:

  table    [max_batch, max_pages] long  row b's pages, then ``fill_page`` to the step's width
  kv_lens  [max_batch]            long  keys row b sees (its new token included)

``update`` (outside the graph) copies the step's lengths and ``width`` table columns in with one
host-to-device copy; ``meta`` (inside the graph) builds the mask from ``kv_lens``, so a replay
masks by the step's lengths.
"""

from __future__ import annotations

import torch

from pdkv.models.attention.base import AttentionBatch, GraphDecodeState

MIN_WIDTH = 8  # pages: the narrowest captured table (128 tokens at 16-token pages)


def table_widths(max_pages: int) -> tuple[int, ...]:
    """8, 16, 32, ... pages, then ``max_pages`` itself (the last may not be a power of two)."""
    widths, w = [], MIN_WIDTH
    while w < max_pages:
        widths.append(w)
        w *= 2
    return (*widths, max_pages)


class TorchGraphDecode(GraphDecodeState):
    def __init__(self, backend, max_batch: int, max_pages: int):
        from pdkv.models.attention.torch_backend import TorchAttentionMeta  # noqa: PLC0415 - no import cycle

        self._meta_cls = TorchAttentionMeta
        P, dev = backend.kv.page_size, backend.kv.device
        self.max_batch, self.max_pages, self.window, self.page_size = max_batch, max_pages, backend.sliding_window, P
        self.widths = table_widths(max_pages)
        # [max_batch, 1 + max_pages]: column 0 the length, then the page table (one copy per step)
        self._buf = torch.zeros(max_batch, 1 + max_pages, dtype=torch.long, device=dev)
        self.kv_lens, self.table = self._buf[:, 0], self._buf[:, 1:]
        self._keys = torch.arange(max_pages * P, device=dev)  # key positions
        self._pin = torch.device(dev).type == "cuda"

    def update(self, batch: AttentionBatch, fill_page: int, width: int) -> None:
        bs = len(batch.kv_lens)
        if bs > self.max_batch or width > self.max_pages:
            raise ValueError(f"a graph step of {bs} rows over {width} pages, but the buffers hold "
                             f"{self.max_batch} x {self.max_pages}")
        rows = []
        for kv_len, pages in zip(batch.kv_lens, batch.page_ids):
            n = -(-kv_len // self.page_size)  # pages holding keys
            if n > width:
                raise ValueError(f"a graph step row of {kv_len} keys needs {n} pages, the table is {width} wide")
            rows.append([kv_len, *pages[:n]] + [fill_page] * (width - n))
        host = torch.tensor(rows, dtype=torch.long)
        self._buf[:bs, :1 + width].copy_(host.pin_memory() if self._pin else host, non_blocking=self._pin)

    def meta(self, bs: int, width: int, write_pages: torch.Tensor, write_offsets: torch.Tensor):
        """Inside the captured function: only tensor ops on the static buffers."""
        keys, lens = self._keys[:width * self.page_size].view(1, 1, -1), self.kv_lens[:bs].view(bs, 1, 1)
        blocked = keys >= lens  # [bs, 1, L]: key j is beyond row b's kv_len
        if self.window is not None:  # row b sits at kv_len - 1 and sees the window before it
            blocked |= keys <= lens - 1 - self.window
        return self._meta_cls(
            write_pages=write_pages, write_offsets=write_offsets, num_decodes=bs, decode_tokens=bs, decode_q=1,
            decode_pages=self.table[:bs, :width].reshape(-1), decode_blocked=blocked, decode_masked=False,
            decode_kv_len=0, decode_lens=None, pad_rows=None, unpad_rows=None, prefills=[])
