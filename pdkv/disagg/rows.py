"""Row pools of a registered hidden-state buffer (one row per request in transfer).

A row is taken on the engine thread at admission (the connector's ``admit``) and given back on
the event loop when the request's slot or job ends; deque ends are atomic, so no lock is needed.
NOTE: giving a row back sends no command to the engine loop, which therefore retries admission
on its own while requests wait (pdkv/engine/loop.py, ADMISSION_RETRY_S).
"""

from __future__ import annotations

import collections

import torch


class RowPool:
    def __init__(self, num_rows: int):
        self.num_rows = num_rows
        self._free = collections.deque(range(num_rows))

    def take(self) -> int | None:
        try:
            return self._free.popleft()
        except IndexError:
            return None

    def give_back(self, row: int) -> None:
        self._free.append(row)


class HiddenRows(RowPool):
    """Decode side: rows of the buffer the prefill node writes each prompt's last hidden state into."""


class StagingRows(RowPool):
    """Prefill side: rows the last hidden state is staged in (its own buffer) before the write."""

    def __init__(self, num_rows: int, hidden_size: int, dtype: torch.dtype):
        super().__init__(num_rows)
        self.buffer = torch.zeros(num_rows, hidden_size, dtype=dtype)  # [rows, hidden_size]
        self.row_nbytes = hidden_size * self.buffer.element_size()
