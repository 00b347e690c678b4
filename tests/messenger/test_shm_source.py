"""A region registered as a write source only (``register_address(..., source_only=True)``, a
prefill node's KV pool): on shm and auto its memory stays private and is allocated only as it is
touched, where a plain registration moves it onto a /dev/shm file of its whole size (both read
from /proc: the mapping in smaps, the file's allocated blocks); writes from it land; granting it
is refused by name on every transport; the shared hand-off may still map granted pages over it,
and unsharing gives those pages back zeroed.
"""
from __future__ import annotations

import mmap
import os

import numpy as np
import pytest

from pdkv._messenger import InvalidRequestError, Messenger
from pdkv.transports import AutoOptions, ShmOptions, TcpOptions

from test_shm_share import PAGE, _wait

POOL = 64 << 20  # a pool big enough that "allocated as touched" and "allocated whole" differ plainly


def _untouched(nbytes: int) -> mmap.mmap:
    """Fresh private anonymous memory, never touched (as pdkv.disagg.node's KV buffer starts)."""
    return mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)


def _mapping(addr: int) -> tuple[str, int]:
    """(path, Rss bytes) of this process's mapping holding ``addr`` (path "" for anonymous)."""
    head, rss = None, 0
    with open("/proc/self/smaps") as f:
        for line in f:
            parts = line.split()
            if "-" in parts[0] and len(parts) >= 5 and ":" in parts[3]:  # a mapping's first line
                if head is not None:
                    break
                lo, hi = (int(x, 16) for x in parts[0].split("-"))
                if lo <= addr < hi:
                    head = parts[5] if len(parts) > 5 else ""
            elif head is not None and parts[0] == "Rss:":
                rss = int(parts[1]) * 1024
    assert head is not None, f"no mapping holds {addr:#x}"
    return head, rss


def _shm_file_bytes(addr: int) -> int:
    """Bytes allocated to the /dev/shm file mapped at ``addr`` (0: not a file mapping)."""
    with open("/proc/self/maps") as f:
        for line in f:
            lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
            if lo <= addr < hi and "/dev/shm/" in line:
                return os.stat(f"/proc/self/map_files/{lo:x}-{hi:x}").st_blocks * 512
    return 0


def _pair(kind: str):
    opts = {"shm": ShmOptions, "auto": AutoOptions}[kind]
    a, b = Messenger(kind, 31, opts()), Messenger(kind, 32, opts())
    same = {"same_host": True} if kind == "auto" else {}
    ca, ia = a.prepare(32, **same)
    cb, ib = b.prepare(31, **same)
    a.complete(ca, ib)
    b.complete(cb, ia)
    return a, b, ca


@pytest.mark.parametrize("kind", ["shm", "auto"])
def test_a_source_stays_private_and_untouched_where_a_plain_region_becomes_a_whole_file(kind):
    a, b, ca = _pair(kind)
    try:
        src_mm, plain_mm = _untouched(POOL), _untouched(POOL)
        src = np.frombuffer(src_mm, dtype=np.uint8)
        plain = np.frombuffer(plain_mm, dtype=np.uint8)
        lkey = a.register_address(src.ctypes.data, POOL, source_only=True)
        a.register_address(plain.ctypes.data, POOL)
        path, rss = _mapping(src.ctypes.data)
        assert path == "" and rss < POOL // 16, (path, rss)  # private, nothing faulted in
        assert _shm_file_bytes(src.ctypes.data) == 0
        assert _mapping(plain.ctypes.data)[0].startswith("/dev/shm/")
        assert _shm_file_bytes(plain.ctypes.data) >= POOL  # the plain one: allocated whole at reg
        # a write from the source lands; only the pages written from are resident
        dst_mm = _untouched(16 * PAGE)
        dst = np.frombuffer(dst_mm, dtype=np.uint8)
        rkey = b.grant_range(b.register(dst), 31, 0, 4 * PAGE)
        src[8 * PAGE:12 * PAGE] = 0x5A
        b.expect(7, 1)
        a.write(ca, lkey, 8 * PAGE, rkey, 0, 4 * PAGE, imm=7)
        assert any(e.kind == "imm_done" for e in _wait(b, "imm_done"))
        assert (dst[:4 * PAGE] == 0x5A).all() and (dst[4 * PAGE:] == 0).all()
        assert _mapping(src.ctypes.data)[1] < POOL // 16
    finally:
        a.close()
        b.close()


@pytest.mark.parametrize("kind", ["shm", "auto", "tcp"])
def test_granting_a_source_is_refused_by_name(kind):
    m = (Messenger("tcp", 41, TcpOptions(host="127.0.0.1")) if kind == "tcp"
         else Messenger(kind, 41, {"shm": ShmOptions, "auto": AutoOptions}[kind]()))
    try:
        mm = _untouched(8 * PAGE)
        buf = np.frombuffer(mm, dtype=np.uint8)
        key = m.register_address(buf.ctypes.data, 8 * PAGE, source_only=True)
        with pytest.raises(InvalidRequestError, match=f"region 0x{key:x} was registered as a write source only"):
            m.grant(key, 42)
        with pytest.raises(InvalidRequestError, match="write source only"):
            m.grant_range(key, 42, 0, PAGE)
        m.deregister(key)
        again = m.register_address(buf.ctypes.data, 8 * PAGE)  # the same memory, plainly: grantable
        m.grant_range(again, 42, 0, PAGE)
    finally:
        m.close()


def test_shared_pages_over_a_source_land_in_the_receiver_and_come_back_zeroed():
    a, b, ca = _pair("shm")
    try:
        src_mm = _untouched(16 * PAGE)
        src = np.frombuffer(src_mm, dtype=np.uint8)
        src[:] = 0xAA
        lkey = a.register_address(src.ctypes.data, 16 * PAGE, source_only=True)
        dst_mm = _untouched(16 * PAGE)
        dst = np.frombuffer(dst_mm, dtype=np.uint8)
        rkey = b.register(dst)
        b.grant_range(rkey, 31, 4 * PAGE, 4 * PAGE)
        a.share_pages(ca, lkey, 2 * PAGE, rkey, 4 * PAGE, 4 * PAGE)
        src[2 * PAGE:6 * PAGE] = 9  # computed in place
        assert (dst[4 * PAGE:8 * PAGE] == 9).all()
        with pytest.raises(Exception, match="outside local region"):
            a.share_pages(ca, lkey, 14 * PAGE, rkey, 4 * PAGE, 4 * PAGE)  # past the source's end
        b.revoke_range(rkey, 31, 4 * PAGE, 4 * PAGE)
        # its own memory again, zeroed (a source has no file to restore from), not the receiver's
        assert (src[2 * PAGE:6 * PAGE] == 0).all()
        assert (src[:2 * PAGE] == 0xAA).all() and (src[6 * PAGE:] == 0xAA).all()
        src[2 * PAGE:6 * PAGE] = 1
        assert (dst[4 * PAGE:8 * PAGE] == 9).all()
        assert _mapping(src.ctypes.data + 2 * PAGE)[0] == ""
    finally:
        a.close()
        b.close()


@pytest.mark.parametrize("kind", ["shm", "auto"])
def test_preallocate_off_allocates_the_file_as_its_pages_are_touched(kind):
    """messenger.shm_preallocate false: a registered region's file has no pages until they are
    used (read from its allocated blocks), its bytes kept, and a grant of it still maps and lands."""
    opts = {"shm": ShmOptions, "auto": AutoOptions}[kind]
    a, b = Messenger(kind, 51, opts()), Messenger(kind, 52, opts(preallocate=False))
    same = {"same_host": True} if kind == "auto" else {}
    try:
        ca, ia = a.prepare(52, **same)
        cb, ib = b.prepare(51, **same)
        a.complete(ca, ib)
        b.complete(cb, ia)
        dst_mm = _untouched(POOL)
        dst = np.frombuffer(dst_mm, dtype=np.uint8)
        dst[:PAGE] = 3  # one page with bytes before registering: kept
        rkey = b.register_address(dst.ctypes.data, POOL)
        assert _mapping(dst.ctypes.data)[0].startswith("/dev/shm/")
        assert _shm_file_bytes(dst.ctypes.data) < POOL // 16  # not allocated whole
        assert (dst[:PAGE] == 3).all()
        src_mm = _untouched(4 * PAGE)
        src = np.frombuffer(src_mm, dtype=np.uint8)
        src[:] = 0x77
        lkey = a.register_address(src.ctypes.data, 4 * PAGE, source_only=True)
        wkey = b.grant_range(rkey, 51, 8 * PAGE, 4 * PAGE)
        b.expect(5, 1)
        a.write(ca, lkey, 0, wkey, 8 * PAGE, 4 * PAGE, imm=5)
        assert any(e.kind == "imm_done" for e in _wait(b, "imm_done"))
        assert (dst[8 * PAGE:12 * PAGE] == 0x77).all()
        assert _shm_file_bytes(dst.ctypes.data) < POOL // 16
        plain = Messenger(kind, 53, opts())  # the default: allocated whole at registration
        try:
            mm = _untouched(POOL)
            buf = np.frombuffer(mm, dtype=np.uint8)
            plain.register_address(buf.ctypes.data, POOL)
            assert _shm_file_bytes(buf.ctypes.data) >= POOL
        finally:
            plain.close()
    finally:
        a.close()
        b.close()
