"""Passing file descriptors between processes on one host (no CUDA here).

A cuMem allocation is exported as a POSIX file descriptor; for rank 0 to import another rank's
KV cache, the descriptor itself must move between the processes. Two ways, both kernel-level:

- :func:`send_fd` / :func:`recv_fd`: SCM_RIGHTS over a Unix socket, with a small JSON header
  (sizes, owner GPU, rank) in the same message, so the descriptor and what it means arrive
  together. Use ``SOCK_SEQPACKET`` sockets: message boundaries are kept, so one recv is one
  header plus its descriptor, never half of one or two glued together.
- :func:`pidfd_getfd`: rank 0 copies descriptor number ``fd`` straight out of process ``pid``
  (Linux >= 5.6; needs ptrace-attach permission on the target, e.g. a child, or same user with
  ``kernel.yama.ptrace_scope`` = 0). No socket, but the target must say which number to take.

The kernel duplicates the descriptor into the receiver; each side closes its own copy.
"""

from __future__ import annotations

import ctypes
import json
import os
import socket
import struct

from pdkv.errors import PdkvError

MAX_HEADER = 4096  # bytes of JSON header per message; a header is a few dozen fields at most
_LEN = struct.Struct("!I")
_SYS_PIDFD_GETFD = 438  # same number on x86-64 and aarch64 (the unified syscall table)


class FdPassError(PdkvError, RuntimeError):
    """A descriptor could not be passed; the message says which side and why."""


def send_fd(sock: socket.socket, fd: int, header: dict) -> None:
    """Send ``fd`` and ``header`` (a JSON-able dict) as one message on a Unix socket.

    The caller keeps ownership of ``fd`` (it may close it right after: the message holds its own
    reference until the receiver takes it).
    """
    if sock.family != socket.AF_UNIX:
        raise FdPassError(f"send_fd needs an AF_UNIX socket, got {sock.family!r}")
    payload = json.dumps(header, separators=(",", ":")).encode()
    if len(payload) > MAX_HEADER:
        raise FdPassError(f"send_fd: header is {len(payload)} bytes, at most {MAX_HEADER} fit")
    try:
        socket.send_fds(sock, [_LEN.pack(len(payload)) + payload], [fd])
    except OSError as e:
        raise FdPassError(f"send_fd: sending descriptor {fd} failed: {e}") from None


def recv_fd(sock: socket.socket) -> tuple[int, dict]:
    """Receive one message sent by :func:`send_fd`: ``(fd, header)``; the caller owns ``fd``.

    Anything malformed (peer closed, no descriptor, extra descriptors, truncated message, bad
    header) raises FdPassError after closing every descriptor that did arrive: nothing leaks.
    """
    try:
        msg, fds, flags, _ = socket.recv_fds(sock, _LEN.size + MAX_HEADER + 1, 4)
    except OSError as e:  # includes socket.timeout
        raise FdPassError(f"recv_fd: receiving failed: {e}") from None
    try:
        if not msg and not fds:
            raise FdPassError("recv_fd: the peer closed the socket before sending a descriptor")
        if flags & (socket.MSG_CTRUNC | socket.MSG_TRUNC):
            raise FdPassError("recv_fd: message truncated (control data or payload too large)")
        if len(fds) != 1:
            raise FdPassError(f"recv_fd: expected exactly one descriptor, got {len(fds)}")
        if len(msg) < _LEN.size or _LEN.unpack_from(msg)[0] != len(msg) - _LEN.size:
            raise FdPassError(f"recv_fd: malformed header ({len(msg)} bytes)")
        try:
            header = json.loads(msg[_LEN.size:])
        except ValueError as e:
            raise FdPassError(f"recv_fd: header is not JSON: {e}") from None
        if not isinstance(header, dict):
            raise FdPassError(f"recv_fd: header must be a JSON object, got {type(header).__name__}")
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise
    return fds[0], header


def pidfd_getfd(pid: int, fd: int) -> int:
    """A duplicate of descriptor ``fd`` of process ``pid`` in this process (caller closes it)."""
    try:
        pidfd = os.pidfd_open(pid)
    except OSError as e:
        raise FdPassError(f"pidfd_getfd: cannot open process {pid}: {e}") from None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.syscall.restype = ctypes.c_long
        out = libc.syscall(ctypes.c_long(_SYS_PIDFD_GETFD), ctypes.c_int(pidfd), ctypes.c_int(fd),
                           ctypes.c_uint(0))
        if out < 0:
            err = ctypes.get_errno()
            hint = {1: " (no ptrace permission on the target: see kernel.yama.ptrace_scope)",
                    38: " (kernel older than 5.6)", 9: " (no such descriptor in the target)"}
            raise FdPassError(f"pidfd_getfd({pid}, {fd}) failed: {os.strerror(err)}"
                              f"{hint.get(err, '')}")
        return int(out)
    finally:
        os.close(pidfd)
