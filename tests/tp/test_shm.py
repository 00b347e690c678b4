"""pdkv.kv.shm: a KV buffer two mappings share, that leaves nothing in /dev/shm once unlinked."""

from __future__ import annotations

import pytest
import torch

from pdkv.kv import KVCache
from pdkv.kv.shm import SharedBuffer


def test_two_mappings_share_memory_and_unlink_keeps_them():
    a = SharedBuffer.create(4096, "test")
    b = SharedBuffer.attach(a.path, 4096)
    assert a.address != b.address and a.tensor().sum() == 0
    cache = KVCache(1, 4, 4, 2, 8, torch.float32, "HND", "cpu", buffer=b.tensor())  # 4 pages x 256 B
    a.unlink()
    assert not a.path.exists()
    cache.layer(0)[2, 1, 0, 3] = torch.arange(8, dtype=torch.float32)  # V, head 0, token 3 of page 2
    off = cache.page_offset(0, 2) + ((1 * 2 + 0) * 4 + 3) * 8 * 4
    assert torch.frombuffer(bytearray(a.read(off, 32)), dtype=torch.float32).tolist() == list(range(8))
    with pytest.raises(FileNotFoundError, match="does not exist"):
        SharedBuffer.attach(a.path, 4096)
    with pytest.raises(ValueError, match="outside the 4096-byte buffer"):
        a.read(4090, 8)


def test_bad_sizes_are_refused():
    with pytest.raises(ValueError, match="nbytes must be >= 1"):
        SharedBuffer.create(0)
    a = SharedBuffer.create(1024, "test")
    try:
        with pytest.raises(ValueError, match="holds 1024 bytes, expected 4096"):
            SharedBuffer.attach(a.path, 4096)
    finally:
        a.unlink()
