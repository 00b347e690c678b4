"""The follower processes (ranks 1..tp-1) as rank 0 sees them: spawn, talk, watch, stop.

Each follower is ``python -m pdkv.tp.worker`` with one end of a control channel (and, on GPUs,
a SEQPACKET socket for cuMem handles). Rank 0 never waits on a follower blindly: every wait
polls the process, so a follower that exits turns into a TPRankError naming its rank, pid, exit
code and, when it managed to send one, its traceback. The first such error is kept: after it,
every check raises it again (the process group is broken; the engine cannot run more steps).
"""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

from pdkv.errors import PdkvError
from pdkv.tp.channel import Channel, ChannelClosed

log = logging.getLogger(__name__)


class TPRankError(PdkvError, RuntimeError):
    """A tensor-parallel rank died, failed, or did not answer in time; the message names it."""


def _repo_root() -> str:
    import pdkv  # noqa: PLC0415 - the folder holding pdkv (a checkout, or site-packages)

    return str(Path(pdkv.__file__).resolve().parent.parent)


class Followers:
    """Ranks 1..n; index lists by rank (slot 0, rank 0 itself, is None)."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen | None] = [None]
        self.chans: list[Channel | None] = [None]
        self.fd_socks: list[socket.socket | None] = [None]  # GPU: cuMem handle sockets
        self.error: TPRankError | None = None
        # Read by shutdown(): a broken group's followers may be stuck in a collective, so they
        # are killed rather than asked to stop.
        self.state = {"broken": False}

    @property
    def ranks(self) -> range:
        return range(1, len(self.procs))

    def spawn(self, with_fd_socket: bool, module: str = "pdkv.tp.worker") -> int:
        """Starts the next rank (``python -m module``); returns it. ``with_fd_socket``: also a
        SCM_RIGHTS socket (GPU)."""
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        fds, argv = [theirs.fileno()], [str(theirs.fileno())]
        fd_mine = fd_theirs = None
        if with_fd_socket:  # cuMem handles travel as SCM_RIGHTS on a SEQPACKET socket (pdkv/gpu/fdpass)
            fd_mine, fd_theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            fds.append(fd_theirs.fileno())
            argv.append(str(fd_theirs.fileno()))
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (_repo_root(), env.get("PYTHONPATH", "")) if p)
        try:
            proc = subprocess.Popen([sys.executable, "-m", module, *argv], pass_fds=fds, env=env)
        except BaseException:
            mine.close()
            if fd_mine is not None:
                fd_mine.close()
            raise
        finally:
            theirs.close()
            if fd_theirs is not None:
                fd_theirs.close()
        self.procs.append(proc)
        self.chans.append(Channel(mine))
        self.fd_socks.append(fd_mine)
        return len(self.procs) - 1

    # ---- health ------------------------------------------------------------------------------
    def alive(self, r: int) -> None:
        """Raises TPRankError if rank ``r`` has exited (with its traceback if it sent one)."""
        code = self.procs[r].poll()
        if code is None:
            return
        detail = ""
        ch = self.chans[r]
        try:
            while ch.readable(0):
                kind, payload = ch.recv()
                if kind == "error":
                    detail = f"; its traceback:\n{payload}"
        except (ChannelClosed, OSError, EOFError):
            pass
        raise self.mark_broken(TPRankError(
            f"tensor-parallel rank {r} (pid {self.procs[r].pid}) exited with code {code}; "
            f"this engine cannot run further steps{detail}"))

    def check(self) -> None:
        """Raises TPRankError if any follower is gone (or was found gone before)."""
        if self.error is not None:
            raise self.error
        for r in self.ranks:
            self.alive(r)

    # ---- messages ----------------------------------------------------------------------------
    def wait_all(self, kind: str, timeout_s: float) -> list:
        """Each follower's next message, which must be ``kind``; returns their payloads."""
        out = []
        deadline = time.monotonic() + timeout_s
        for r in self.ranks:
            msg = self.chans[r].recv_until(deadline, lambda r=r: self.alive(r))
            if msg is None:
                raise TPRankError(f"tensor-parallel rank {r} did not report {kind!r} within {timeout_s:g} s")
            if msg[0] == "error":
                self.error = TPRankError(f"tensor-parallel rank {r} failed before {kind!r}:\n{msg[1]}")
                raise self.error
            if msg[0] != kind:
                raise TPRankError(f"tensor-parallel rank {r} sent {msg[0]!r}, expected {kind!r}")
            out.append(msg[1])
        return out

    def send_all(self, kind: str, payload=None) -> None:
        """Sends one message to every follower (pickled once)."""
        framed = Channel.pack(kind, payload)
        for r in self.ranks:
            try:
                self.chans[r].send_packed(framed)
            except ChannelClosed:
                self.alive(r)  # names the rank if it died; else the channel broke some other way
                raise

    # ---- shutdown ----------------------------------------------------------------------------
    def mark_broken(self, error: TPRankError) -> TPRankError:
        """The ranks are out of step (a collective failed): nothing may run on this group again."""
        self.error = self.error or error
        self.state["broken"] = True
        return self.error

    @staticmethod
    def shutdown(procs, chans, fd_socks, state, wait_s: float = 10.0) -> None:
        """Asks every follower to stop, waits, kills one that does not (at once if the group is
        broken). Static, over the lists, so a weakref.finalize can run it without keeping the
        owner alive."""
        if state["broken"]:
            for p in procs[1:]:
                if p.poll() is None:
                    p.kill()
        for ch in chans[1:]:
            try:
                ch.send("stop")
            except (ChannelClosed, OSError):
                pass
        deadline = time.monotonic() + wait_s
        for p in procs[1:]:
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("tensor-parallel follower (pid %d) did not stop; killing it", p.pid)
                p.kill()
                p.wait()
        for ch in chans[1:]:
            ch.close()
        for s in fd_socks[1:]:
            if s is not None:
                s.close()

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs[1:]]
