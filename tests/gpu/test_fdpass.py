"""Passing descriptors between real processes: SCM_RIGHTS with a header, and pidfd_getfd.

The descriptors here are memfds (what a CPU build shares); a cuMem export is a descriptor too
and travels the same way (tests/gpu/test_gpu.py does that on a GPU).
"""

from __future__ import annotations

import mmap
import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from pdkv.gpu.fdpass import FdPassError, pidfd_getfd, recv_fd, send_fd

REPO = Path(__file__).resolve().parents[2]


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _python(code: str, *args: str, **kw) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", textwrap.dedent(code), *args],
                            env=dict(os.environ, PYTHONPATH=str(REPO)), text=True,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, **kw)


def test_memory_shared_through_a_passed_descriptor_is_seen_both_ways(tmp_path):
    """The child ("rank 1") fills a memfd, sends it with its header; we ("rank 0") check the bytes
    and write the second half; the child checks it sees our half in its own mapping."""
    before = _open_fds()
    path = str(tmp_path / "h.sock")
    server = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    server.bind(path)
    server.listen(1)
    server.settimeout(30)
    child = _python("""
        import mmap, os, socket, sys
        from pdkv.gpu.fdpass import send_fd
        n = 1 << 16
        fd = os.memfd_create("kv")
        os.ftruncate(fd, n)
        m = mmap.mmap(fd, n)
        m[:] = bytes(i * 7 % 251 for i in range(n))
        s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        s.settimeout(30)
        s.connect(sys.argv[1])
        send_fd(s, fd, {"rank": 1, "nbytes": n})
        os.close(fd)
        assert s.recv(16) == b"check"
        ok = m[n // 2:] == bytes(i * 13 % 253 for i in range(n // 2)) and m[:n // 2] == bytes(i * 7 % 251 for i in range(n // 2))
        s.send(b"ok" if ok else b"bad")
    """, path)
    try:
        conn, _ = server.accept()
        with conn:
            fd, header = recv_fd(conn)
            assert header == {"rank": 1, "nbytes": 1 << 16}
            n = header["nbytes"]
            with mmap.mmap(fd, n) as m:
                os.close(fd)
                assert m[:] == bytes(i * 7 % 251 for i in range(n))
                m[n // 2:] = bytes(i * 13 % 253 for i in range(n // 2))
                conn.send(b"check")
                assert conn.recv(16) == b"ok", child.communicate()[0]
        assert child.wait(30) == 0, child.communicate()[0]
    finally:
        child.kill()
        child.communicate()
        server.close()
    assert _open_fds() == before  # socket, connection, received descriptor and pipes all closed


@pytest.fixture
def pair():
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    b.settimeout(5)
    yield a, b
    a.close()
    b.close()


def test_a_message_without_a_descriptor_is_refused(pair):
    a, b = pair
    a.send(b"\x00\x00\x00\x02{}")
    with pytest.raises(FdPassError, match="expected exactly one descriptor, got 0"):
        recv_fd(b)


def test_bad_headers_are_refused_and_their_descriptors_closed(pair):
    a, b = pair
    r, w = os.pipe()
    try:
        before = _open_fds()
        socket.send_fds(a, [b"\x00\x00\x00\x05[1,2]"], [r])
        with pytest.raises(FdPassError, match="header must be a JSON object, got list"):
            recv_fd(b)
        socket.send_fds(a, [b"\x00\x00\x00\x09not json!"], [r])
        with pytest.raises(FdPassError, match="header is not JSON"):
            recv_fd(b)
        socket.send_fds(a, [b"\x00\x00\x00\x07{}"], [r])
        with pytest.raises(FdPassError, match="malformed header"):
            recv_fd(b)
        socket.send_fds(a, [b"\x00\x00\x00\x02{}"], [r, w])
        with pytest.raises(FdPassError, match="exactly one descriptor, got 2"):
            recv_fd(b)
        assert _open_fds() == before  # every received duplicate was closed
    finally:
        os.close(r)
        os.close(w)


def test_peer_closing_and_oversized_headers_are_clear_errors(pair):
    a, b = pair
    with pytest.raises(FdPassError, match="header is .* bytes, at most 4096 fit"):
        send_fd(a, 0, {"x": "y" * 5000})
    with pytest.raises(FdPassError, match="needs an AF_UNIX socket"):
        send_fd(socket.socket(socket.AF_INET, socket.SOCK_STREAM), 0, {})
    a.close()
    with pytest.raises(FdPassError, match="peer closed the socket"):
        recv_fd(b)


def test_a_received_header_that_is_not_a_cumem_handle_leaks_nothing(pair):
    from pdkv.gpu.cumem import CuMemAllocation

    a, b = pair
    r, w = os.pipe()
    try:
        before = _open_fds()
        send_fd(a, r, {"kind": "shm", "rank": 1})
        with pytest.raises(ValueError, match="not a cuMem handle message"):
            CuMemAllocation.receive(b)
        assert _open_fds() == before
    finally:
        os.close(r)
        os.close(w)


def test_pidfd_getfd_takes_a_descriptor_out_of_a_child():
    child = _python("""
        import os, sys
        fd = os.memfd_create("kv")
        os.write(fd, b"rank-1 kv bytes")
        print(fd, flush=True)
        sys.stdin.readline()
    """)
    try:
        fd_number = int(child.stdout.readline())
        try:
            fd = pidfd_getfd(child.pid, fd_number)
        except FdPassError as e:
            if "Operation not permitted" in str(e) or "kernel older" in str(e):
                pytest.skip(f"pidfd_getfd not allowed here: {e}")
            raise
        try:
            assert os.pread(fd, 64, 0) == b"rank-1 kv bytes"
        finally:
            os.close(fd)
        with pytest.raises(FdPassError, match=r"pidfd_getfd\(\d+, 999\) failed: Bad file descriptor"):
            pidfd_getfd(child.pid, 999)
    finally:
        child.stdin.close()
        child.wait(10)
    with pytest.raises(FdPassError, match="cannot open process"):
        pidfd_getfd(child.pid, fd_number)  # reaped: no such process
