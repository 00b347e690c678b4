"""Shared-memory KV cache buffers on the CPU, so that rank 0 maps every tensor-parallel rank's cache.

With tensor parallelism each rank holds its slice of the KV cache, but one messenger (in rank 0)
posts every page write. On the GPU the cache memory comes from cuMem and is imported into rank 0
(pdkv/gpu/cumem.py); on the CPU it is a file in ``/dev/shm`` that every process maps with
``MAP_SHARED``: rank 0 creates one file per rank, each rank maps its own as the backing of its
``KVCache(buffer=...)``, and rank 0 keeps a mapping of all of them, so the address it hands the
messenger for rank r is memory rank r's forward pass writes.

NOTE: the files are unlinked as soon as every rank has mapped them (``unlink``): the memory then
lives exactly as long as the mappings, and a crash leaves nothing behind in /dev/shm.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import secrets
import tempfile
import weakref
from pathlib import Path

import torch

SHM_DIR = Path("/dev/shm")


def _dir() -> Path:
    return SHM_DIR if SHM_DIR.is_dir() and os.access(SHM_DIR, os.W_OK) else Path(tempfile.gettempdir())


class SharedBuffer:
    """``nbytes`` of memory in a named file, mapped shared. ``tensor()`` is a flat uint8 view
    ``[nbytes]`` (no copy) for ``KVCache(buffer=...)``; ``address`` is where it is mapped here."""

    def __init__(self, path: Path, nbytes: int, owner: bool):
        self.path, self.nbytes, self.owner = path, nbytes, owner
        fd = os.open(path, os.O_RDWR)
        try:
            size = os.fstat(fd).st_size
            if size < nbytes:
                raise ValueError(f"{path}: shared KV buffer holds {size} bytes, expected {nbytes}")
            self._map = mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)  # the mapping keeps the memory; no descriptor to leak
        self._tensor = torch.frombuffer(self._map, dtype=torch.uint8)
        self.address = self._tensor.data_ptr()
        self._unlinked = False

    @classmethod
    def create(cls, nbytes: int, tag: str = "kv") -> SharedBuffer:
        """A new zero-filled buffer (pages are allocated on first touch, not here)."""
        if int(nbytes) < 1:
            raise ValueError(f"SharedBuffer.create: nbytes must be >= 1, got {nbytes}")
        path = _dir() / f"pdkv-{tag}-{os.getpid()}-{secrets.token_hex(4)}"
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, int(nbytes))
        except OSError:
            os.close(fd)
            path.unlink(missing_ok=True)
            raise
        os.close(fd)
        try:
            buf = cls(path, int(nbytes), owner=True)
        except BaseException:
            path.unlink(missing_ok=True)
            raise
        # Backstop for an owner that never reaches unlink() (startup failed): GC or exit removes it.
        weakref.finalize(buf, path.unlink, missing_ok=True)
        return buf

    @classmethod
    def attach(cls, path: str | Path, nbytes: int) -> SharedBuffer:
        """Maps a buffer another process created (before it was unlinked)."""
        path = Path(path)
        if not path.exists():
            raise FileNotFoundError(f"shared KV buffer {path} does not exist (unlinked already, or "
                                    "created on another host)")
        return cls(path, int(nbytes), owner=False)

    def tensor(self) -> torch.Tensor:
        """Flat ``uint8`` ``[nbytes]`` over the mapping."""
        return self._tensor

    def read(self, offset: int, nbytes: int) -> bytes:
        """A copy of [offset, offset + nbytes) through this process's mapping (tests, debugging)."""
        if not (0 <= offset and 0 <= nbytes and offset + nbytes <= self.nbytes):
            raise ValueError(f"read [{offset}, {offset + nbytes}) outside the {self.nbytes}-byte buffer")
        return ctypes.string_at(self.address + offset, nbytes)

    def unlink(self) -> None:
        """Removes the name; mappings stay valid. Only the creator unlinks; idempotent."""
        if self.owner and not self._unlinked:
            self.path.unlink(missing_ok=True)
            self._unlinked = True

    def __repr__(self) -> str:
        return f"SharedBuffer({self.path}, {self.nbytes} bytes at {self.address:#x})"
