"""The control channel between rank 0 and one follower rank: length-prefixed pickles over a Unix
stream socket (one end of a socketpair made before the follower is spawned).

Why a socket rather than a torch.distributed broadcast: a follower waits for the next step for as
long as the server is idle, and a collective would time out; a blocking ``recv`` waits forever
and returns EOF the moment rank 0's process is gone, which is how a follower learns to exit.
Both ends are trusted processes of one deployment (same user, same host), so pickle is fine.

Messages are tuples ``(kind, payload)``:
  rank 0 → follower:  ("init", dict) ("kv", dict) ("step", StepMeta) ("stop", None)
  follower → rank 0:  ("hello", pid) ("loaded", None) ("ready", dict) ("error", traceback text)
"""

from __future__ import annotations

import pickle
import select
import socket
import struct
import time

_LEN = struct.Struct("<Q")


class ChannelClosed(EOFError):
    """The other end went away (process exit or close)."""


class Channel:
    def __init__(self, sock: socket.socket):
        self.sock = sock

    @staticmethod
    def pack(kind: str, payload=None) -> bytes:
        """One framed message, to send to several peers with ``send_packed`` (pickled once)."""
        data = pickle.dumps((kind, payload), protocol=pickle.HIGHEST_PROTOCOL)
        return _LEN.pack(len(data)) + data

    def send(self, kind: str, payload=None) -> None:
        self.send_packed(self.pack(kind, payload))

    def send_packed(self, framed: bytes) -> None:
        try:
            self.sock.sendall(framed)
        except (BrokenPipeError, ConnectionResetError) as e:
            raise ChannelClosed(f"peer closed the channel ({e})") from None

    def _exact(self, n: int) -> bytes:
        buf = bytearray()
        while len(buf) < n:
            try:
                chunk = self.sock.recv(n - len(buf))
            except ConnectionResetError:
                chunk = b""
            if not chunk:
                raise ChannelClosed("peer closed the channel")
            buf += chunk
        return bytes(buf)

    def recv(self) -> tuple[str, object]:
        """Blocks until a whole message arrives; ChannelClosed on EOF."""
        (n,) = _LEN.unpack(self._exact(_LEN.size))
        return pickle.loads(self._exact(n))

    def readable(self, timeout: float) -> bool:
        r, _, _ = select.select([self.sock], [], [], max(0.0, timeout))
        return bool(r)

    def recv_until(self, deadline: float, alive) -> tuple[str, object] | None:
        """Waits for a message until ``deadline`` (time.monotonic), calling ``alive()`` between
        short waits (it raises if the peer died). None on timeout."""
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            if self.readable(min(left, 0.2)):
                return self.recv()
            alive()

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass
