"""What only the shm transport has: a grant is a mapping in the writer's process.

The writer maps exactly the granted bytes of the receiver's registered memory, rounded to OS
pages, while the grant is held (read from /proc/PID/maps: mappings of the receiver's files), and
nothing of it once revoked or once the receiver is gone. A write outside its grant, even on an
OS page that is mapped, is refused and lands nothing; a peer claiming this host that is not, or
a shared-memory directory too small, is a clear error.
"""
from __future__ import annotations

import os
import subprocess
import tempfile

import numpy as np
import pytest

from pdkv._messenger import Messenger
from pdkv.transports import ShmOptions

PAGE = os.sysconf("SC_PAGE_SIZE")
SIZE = 64 << 10


@pytest.fixture
def transport():
    return "shm"


def _files_of(pid: int) -> dict[int, int]:
    """{inode: bytes mapped} of the unnamed /dev/shm files process pid maps."""
    out: dict[int, int] = {}
    with open(f"/proc/{pid}/maps") as f:
        for line in f:
            parts = line.split(maxsplit=5)
            if len(parts) == 6 and parts[5].startswith("/dev/shm/#"):
                lo, hi = (int(x, 16) for x in parts[0].split("-"))
                out[int(parts[4])] = out.get(int(parts[4]), 0) + hi - lo
    return out


def _mapped_from(writer, receiver) -> int:
    """Bytes of the receiver's shared files mapped in the writer's process."""
    theirs = _files_of(receiver.proc.pid)
    return sum(n for ino, n in _files_of(writer.proc.pid).items() if ino in theirs)


@pytest.fixture
def pair(spawn, connect):
    a, b = spawn(1), spawn(2)
    a.alloc("src", SIZE, seed=7)
    b.alloc("dst", SIZE)
    region = b.register("dst")
    ca, _ = connect(a, b)
    return a, b, ca, region, a.register("src")


def test_a_grant_maps_only_its_pages_until_revoked(pair):
    a, b, ca, region, lkey = pair
    assert _mapped_from(a, b) == 0  # connected, nothing granted: nothing of b mapped in a
    off, ln = 3 * PAGE + 100, 2 * PAGE  # straddles 3 OS pages
    key = b.m("grant_range", region, 1, off, ln)
    assert _mapped_from(a, b) == 3 * PAGE
    b.m("expect", 5, 1)
    a.m("write", ca, lkey, 0, key, off, ln, imm=5)
    assert any(e[0] == "imm_done" for e in b.wait("imm_done", imm=5))
    assert b.read("dst", off, ln) == a.read("src", 0, ln)
    assert b.read("dst", 0, off) == bytes(off) and b.read("dst", off + ln) == bytes(SIZE - off - ln)
    b.m("revoke_range", region, 1, off, ln)
    assert _mapped_from(a, b) == 0  # unmapped in the writer before revoke returned
    assert b.guards_ok("dst")


def test_a_write_past_its_grant_on_a_mapped_page_lands_nothing(pair):
    """The check is the granted bytes, not the OS page they were rounded to."""
    a, b, ca, region, lkey = pair
    key = b.m("grant_range", region, 1, 0, 1000)  # one OS page mapped, 1000 bytes granted
    a.m("write", ca, lkey, 0, key, 900, 200, imm=6)  # ends 100 bytes past the grant, same page
    assert any(e[0] == "error" or (e[0] == "batch_done" and e[6] > 0) for e in a.wait("failed", timeout=10))
    errs = [e for e in b.wait("error", timeout=10) if e[0] == "error"]
    assert errs and errs[0][3] == 1 and "not granted" in errs[0][-1], errs
    assert b.read("dst") == bytes(SIZE) and b.m("stats")["refused_writes"] == 1
    assert a.proc.poll() is None and b.proc.poll() is None  # no SIGSEGV / SIGBUS anywhere


def test_receiver_killed_leaves_nothing_mapped_in_the_writer(pair):
    a, b, ca, region, lkey = pair
    b.m("grant", region, 1)
    theirs = set(_files_of(b.proc.pid))
    mapped = sum(n for ino, n in _files_of(a.proc.pid).items() if ino in theirs)
    assert SIZE <= mapped <= SIZE + PAGE  # the whole region, rounded out to OS pages
    b.kill()
    assert any(e[0] == "error" for e in a.wait("error", timeout=10))  # the writer is told
    assert not theirs & set(_files_of(a.proc.pid))  # and has unmapped all of it


def test_a_peer_on_another_host_is_refused_naming_both():
    a, b = Messenger("shm", 1), Messenger("shm", 2)
    try:
        ca, _ = a.prepare(2)
        _, info = b.prepare(1)
        forged = bytearray(info)
        forged[16:16 + 36] = b"00000000-0000-0000-0000-000000000000"  # the boot id field
        with pytest.raises(Exception, match="is on another host .*boot id 0{8}-.*here "):
            a.complete(ca, bytes(forged))
    finally:
        a.close(), b.close()


def test_shm_dir_too_small_names_bytes_needed_and_free():
    d = tempfile.mkdtemp(prefix="pdkv-small-shm-")
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", d], capture_output=True).returncode:
        os.rmdir(d)
        pytest.skip("cannot mount a small tmpfs here (needs root)")
    m = Messenger("shm", 1, ShmOptions(dir=d))
    try:
        buf = np.zeros(4 << 20, dtype=np.uint8)
        with pytest.raises(Exception, match=rf"{d} has 262144 bytes free, registering this region needs 419\d+"):
            m.register(buf)
        small = np.ones(64 << 10, dtype=np.uint8)
        m.register(small)  # fits: a region smaller than the free space works
        assert small.sum() == 64 << 10  # its bytes moved with it
    finally:
        m.close()
        # lazily: this process keeps the heap pages that moved onto it mapped
        subprocess.run(["umount", "-l", d], capture_output=True)
        os.rmdir(d)
