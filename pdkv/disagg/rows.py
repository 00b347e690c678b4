"""Row pools of a registered hidden-state buffer (one row per request in transfer).

A row is taken on the engine thread at admission (the connector's ``admit``) and given back on
the event loop when the request's slot or job ends; deque ends are atomic, so no lock is needed.
A request that found no free row waits in the engine loop's admission queue, which sleeps until
a command arrives: ``on_free`` (the node sets it to post pdkv.engine.loop.Wake) is that command.
"""

from __future__ import annotations

import collections
from collections.abc import Callable

import torch


class RowPool:
    def __init__(self, num_rows: int, on_free: Callable[[], None] | None = None):
        self.num_rows = num_rows
        self.on_free = on_free  # called after a row is given back (any thread)
        self._free = collections.deque(range(num_rows))

    def take(self) -> int | None:
        try:
            return self._free.popleft()
        except IndexError:
            return None

    def give_back(self, row: int) -> None:
        self._free.append(row)
        if self.on_free is not None:
            self.on_free()


class HiddenRows(RowPool):
    """Decode side: rows of the buffer the prefill node writes each prompt's last hidden state into."""


class StagingRows(RowPool):
    """Prefill side: rows the last hidden state is staged in (its own buffer) before the write."""

    def __init__(self, num_rows: int, hidden_size: int, dtype: torch.dtype):
        super().__init__(num_rows)  # on_free: set by the coordinator once its engine loop exists
        self.buffer = torch.zeros(num_rows, hidden_size, dtype=dtype)  # [rows, hidden_size]
        self.row_nbytes = hidden_size * self.buffer.element_size()
