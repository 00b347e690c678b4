"""Role processes forked from one parent that has imported torch and pdkv already.

Two role processes started with ``python -m pdkv serve`` each import torch, numpy, tokenizers and
pdkv themselves: every module's objects (code, dicts, torch's operator registry) are private
memory of each process, about as much again as a small model's weights. Forked from one parent
after those imports, the processes share those pages copy-on-write, and a page stays shared until
one of them writes to it (the parent freezes its objects out of the garbage collector's sight,
``gc.freeze``: a collection writes to every object it visits). Measured on CPython 3.11, most of
the parent's Python heap is copied into each child anyway (reference counts are writes), so what
stays shared is mostly what the imports allocated outside Python objects.

``python -m pdkv.forkserver --fd N`` is that parent: it imports what ``pdkv serve`` needs, checks
that it runs one thread (a fork copies only the calling thread, so a lock another thread held
would stay held in the child for good), then serves its launcher over the Unix socket ``N``, one
JSON object a line:

- ``{"op": "spawn", "argv": [...], "env": {...}, "log": PATH|null}`` -> ``{"pid": N}``: a child
  in its own session, stdin /dev/null, stdout and stderr appended to PATH (null: the parent's),
  the environment ``env``, runs ``pdkv.cli.main(argv)`` and exits with its status. Each child
  sets its own threads and CPUs as ``pdkv serve`` does (``parallel.cpus``, the engine's threads).
- the parent sends ``{"exit": pid, "status": S}`` when a child ends (S as Popen.returncode:
  negative for a signal), and reaps it; it holds no torch state beyond the imports.

When the launcher goes (its end of the socket closes) the parent sends SIGTERM to the children
still running, SIGKILL to those left after ``GRACE_S``, and exits once none is left. Signals to a
role go to its pid (``ForkedChild``); a SIGTERM or SIGINT to the parent is forwarded to every
child. ``ForkServer`` is the launcher's side; ``fork_enabled`` reads the ``fork`` key of a
cluster or architecture file.
"""

from __future__ import annotations

import gc
import json
import os
import selectors
import signal
import socket
import subprocess
import sys
import threading
import time

GRACE_S = 20.0
# what ``pdkv serve`` imports on its way to serving (the rest is small); imported before any fork
PRELOAD = ("torch", "numpy", "tokenizers", "yaml", "pdkv.cli", "pdkv.config", "pdkv.engine", "pdkv.disagg.node",
           "pdkv.server", "pdkv.server.app", "pdkv._messenger", "pdkv.shared_weights")


class ForkError(RuntimeError):
    """The fork server could not start or answer; the message says why."""


def fork_enabled(value, where: str) -> bool:
    """The ``fork`` key of a cluster / architecture file: true (absent) or false."""
    if value is None:
        return True
    if not isinstance(value, bool):
        from pdkv.config import ConfigError  # noqa: PLC0415

        raise ConfigError(f"{where}: fork must be true or false (start the role processes by fork from one "
                          f"parent that imported torch and pdkv), got {value!r}")
    return value


def num_threads() -> int:
    return len(os.listdir("/proc/self/task"))


# ---- the parent (python -m pdkv.forkserver) ----

def _status(wstatus: int) -> int:
    return -os.WTERMSIG(wstatus) if os.WIFSIGNALED(wstatus) else os.WEXITSTATUS(wstatus)


def _child(req: dict, parents: list) -> None:
    """In the forked child: become the role process; never returns. ``parents``: the parent's
    sockets, pipes and selector, closed here."""
    rc = 1
    try:
        for x in parents:
            x.close() if hasattr(x, "close") else os.close(x)
        os.setsid()  # its own session, as a subprocess with start_new_session: a killpg takes only it
        for s in (signal.SIGTERM, signal.SIGINT, signal.SIGCHLD):
            signal.signal(s, signal.SIG_DFL)
        signal.set_wakeup_fd(-1)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.close(null)
        if req.get("log"):
            out = os.open(req["log"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            os.dup2(out, 1)
            os.dup2(out, 2)
            os.close(out)
        os.environ.clear()
        os.environ.update(req["env"])
        import random  # noqa: PLC0415 - a fork copies the parent's generator: each child its own
        import runpy  # noqa: PLC0415

        random.seed()
        # what `python -m pdkv ARGV` would run, by name as an exec would (its modules are imported
        # already, PRELOAD); it ends in SystemExit with the command's status
        sys.argv = ["pdkv", *req["argv"]]
        runpy.run_module("pdkv", run_name="__main__", alter_sys=True)
        rc = 0
    except SystemExit as e:
        rc = e.code if isinstance(e.code, int) else 1
    except BaseException:  # noqa: BLE001 - the child must exit here whatever happened, with its traceback
        import traceback  # noqa: PLC0415

        traceback.print_exc()
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(rc if isinstance(rc, int) else 1)


def serve(fd: int) -> int:
    sock = socket.socket(fileno=fd)
    for name in PRELOAD:
        __import__(name)
    # the collector writes into every object it tracks, which would copy each page of the imports
    # into each child at its first collection: what exists now is frozen out of its sight
    gc.collect()
    gc.freeze()
    threads = num_threads()
    if threads != 1:  # a fork now could leave a child with a lock some other thread holds
        sock.sendall((json.dumps({"error": f"the fork server runs {threads} threads after importing pdkv; "
                                             "it forks only with one (set fork: false)"}) + "\n").encode())
        return 1
    children: set[int] = set()
    r, w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
    signal.set_wakeup_fd(w)  # SIGCHLD, SIGTERM and SIGINT wake the loop
    forward = {"sig": None}

    def on_signal(sig, _frame):
        forward["sig"] = sig
    signal.signal(signal.SIGCHLD, lambda *_: None)
    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    sel = selectors.DefaultSelector()
    sel.register(sock, selectors.EVENT_READ)
    sel.register(r, selectors.EVENT_READ)
    sock.sendall(b'{"ready": true}\n')
    buf, launcher_gone, deadline = b"", False, None
    while not (launcher_gone and not children):
        timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
        for key, _ in sel.select(timeout):
            if key.fileobj == r:
                while True:
                    try:
                        if not os.read(r, 512):
                            break
                    except BlockingIOError:
                        break
            else:
                data = sock.recv(65536)
                if not data:
                    launcher_gone = True
                    sel.unregister(sock)
                buf += data
        if forward["sig"] is not None:
            for pid in children:
                _kill(pid, forward["sig"])
            forward["sig"] = None
        while b"\n" in buf:
            line, buf = buf.split(b"\n", 1)
            req = json.loads(line)
            if num_threads() != 1:  # nothing here starts one, but a fork beside one is never safe
                sock.sendall((json.dumps({"error": f"the fork server runs {num_threads()} threads"}) + "\n").encode())
                continue
            pid = os.fork()
            if pid == 0:
                _child(req, [sel, sock, r, w])
            children.add(pid)
            sock.sendall((json.dumps({"pid": pid}) + "\n").encode())
        while children:  # reap every child that ended, and say so
            pid, st = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            children.discard(pid)
            if not launcher_gone:
                try:
                    sock.sendall((json.dumps({"exit": pid, "status": _status(st)}) + "\n").encode())
                except OSError:
                    launcher_gone = True
        if launcher_gone and children:
            if deadline is None:  # the launcher went without stopping them: stop them, then force them
                deadline = time.monotonic() + GRACE_S
                for pid in children:
                    _kill(pid, signal.SIGTERM)
            elif time.monotonic() >= deadline:
                for pid in children:
                    _kill(pid, signal.SIGKILL)
                deadline = time.monotonic() + GRACE_S
    return 0


def _kill(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


# ---- the launcher's side ----

class ForkServer:
    """A running fork server, and the children it forked for this launcher."""

    def __init__(self, timeout: float = 120.0, env: dict | None = None):
        mine, theirs = socket.socketpair()
        self.sock = mine
        # numpy's OpenBLAS starts a thread per CPU at import unless told one: the server must stay
        # single-threaded. The children compute with torch's threads, which each sets itself.
        env = {**(env if env is not None else os.environ), "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"}
        self.proc = subprocess.Popen([sys.executable, "-m", "pdkv.forkserver", "--fd", str(theirs.fileno())],
                                     pass_fds=(theirs.fileno(),), start_new_session=True, env=env)
        theirs.close()
        self._buf = b""
        self._mu = threading.Lock()
        self._replies: list[dict] = []
        self.status: dict[int, int] = {}  # pid -> exit status, of the children that ended
        first = self._reply(timeout)
        if not first.get("ready"):
            self.close()
            raise ForkError(first.get("error") or f"the fork server did not start: {first}")

    def _line(self, timeout: float) -> bool:
        """Read one message within ``timeout`` s (False: none came): an exit goes to ``status``,
        anything else to the replies ``_reply`` takes. Under ``_mu``: the harness's sampler thread
        polls for exits while its main thread waits for a spawn's reply."""
        with self._mu:
            self.sock.settimeout(timeout)
            try:
                while b"\n" not in self._buf:
                    data = self.sock.recv(65536)
                    if not data:
                        raise ForkError(f"the fork server (pid {self.proc.pid}) exited with status "
                                        f"{self.proc.wait()}")
                    self._buf += data
            except (TimeoutError, BlockingIOError):
                return False
            line, self._buf = self._buf.split(b"\n", 1)
            msg = json.loads(line)
            if "exit" in msg:
                self.status[msg["exit"]] = msg["status"]
            else:
                self._replies.append(msg)
            return True

    def _reply(self, timeout: float) -> dict:
        end = time.monotonic() + timeout
        while not self._replies:
            if time.monotonic() >= end:
                raise ForkError(f"the fork server (pid {self.proc.pid}) did not answer in {timeout:.0f} s")
            self._line(min(0.2, max(0.0, end - time.monotonic())))
        return self._replies.pop(0)

    def poll_events(self) -> None:
        """Take the exits the server reported so far (never blocks)."""
        while self._line(0.0):
            pass

    def spawn(self, argv: list[str], env: dict, log: str | None = None) -> "ForkedChild":
        with self._mu:
            self.sock.settimeout(30.0)
            self.sock.sendall((json.dumps({"op": "spawn", "argv": list(argv), "env": dict(env), "log": log})
                               + "\n").encode())
        reply = self._reply(30.0)
        if "pid" not in reply:
            raise ForkError(f"the fork server could not start {argv[:1]}: {reply}")
        return ForkedChild(self, reply["pid"])

    def close(self, timeout: float = 60.0) -> None:
        """Stop the server (it stops the children still running) and wait for it."""
        self.sock.close()
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


class ForkedChild:
    """A forked role process, as much of subprocess.Popen as the launchers use."""

    def __init__(self, server: ForkServer, pid: int):
        self.server, self.pid = server, pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            try:
                self.server.poll_events()
            except ForkError:  # the server is gone, and with it its children
                self.returncode = self.server.status.get(self.pid, -signal.SIGKILL)
            self.returncode = self.server.status.get(self.pid, self.returncode)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        end = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if end is not None and time.monotonic() >= end:
                raise subprocess.TimeoutExpired(f"pid {self.pid}", timeout)
            time.sleep(0.05)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            _kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def main(argv: list[str] | None = None) -> int:
    import argparse  # noqa: PLC0415

    p = argparse.ArgumentParser(prog="python -m pdkv.forkserver")
    p.add_argument("--fd", type=int, required=True, help="the launcher's Unix socket")
    return serve(p.parse_args(argv).fd)


if __name__ == "__main__":
    sys.exit(main())
