"""Free TCP ports for nodes that a launcher starts as child processes.

The usual trick -- bind port 0, read the number, close, hand it to a child -- picks from the
kernel's *ephemeral* range (``net.ipv4.ip_local_port_range``, 32768-60999 on Linux). Every
outgoing connection on the host draws its local port from that same range, so between the close
and the child's bind another connection can take the number and the child dies with "address
already in use" (it happened in CI: a prefill node's API port was taken by a client socket).

:func:`free_port` instead hands out ports *below* the ephemeral range, where the kernel never
assigns one on its own, each number at most once per process, starting at an offset drawn from
the process id so that two launchers on one host rarely probe the same numbers; a number is
handed out only if it can be bound right now.
"""

from __future__ import annotations

import itertools
import os
import socket
import threading

_LOW = 20000  # below this are the well-known and registered services people run by hand


def _ephemeral_low(path: str = "/proc/sys/net/ipv4/ip_local_port_range") -> int:
    try:
        with open(path) as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


_HIGH = max(_LOW + 1000, _ephemeral_low())
_lock = threading.Lock()
_span = _HIGH - _LOW
_next = itertools.count((os.getpid() * 7919) % _span)


def _bindable(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the node's server will
        try:
            s.bind((host, port))
            return True
        except OSError:
            return False


def free_port(host: str = "127.0.0.1") -> int:
    """A port on ``host`` that nothing is bound to and that this process has not handed out."""
    with _lock:
        for _ in range(_span):
            port = _LOW + next(_next) % _span
            if _bindable(host, port):
                return port
    raise OSError(f"no free port on {host} in {_LOW}-{_HIGH - 1}")
