"""The suite's last resort against a test that hangs where pytest-timeout cannot reach it.

pytest-timeout's signal method raises in the main thread when it next runs Python: a test stuck
inside C (a nogil poll loop, a join in an extension's teardown, a lock that is never released)
never does, and its xdist worker then holds the whole run until CI's own limit, with nothing
printed about where. Nothing inside the stuck worker can be relied on to end it either: a thread
needs the GIL to run Python, and the main thread may hold it while it waits in C; a new thread
(faulthandler's timer) may block in its first malloc if an allocator lock is stuck.

So the deadline is kept by a separate process, this file run as a script, one per pytest
process. The worker tells it over a pipe which test item runs and for how long (setup, call and
teardown together, a margin past pytest-timeout's). When a deadline passes it names the item on
the worker's real stderr, sends SIGUSR2, on which faulthandler's C handler in the worker prints
every thread's stack (no GIL, no allocation), then SIGKILLs every process below the worker and the
worker itself. xdist reports that test as a crashed worker and goes on with a fresh one. When the
worker exits, the pipe closes and the watchdog process exits with it.
"""
from __future__ import annotations

import faulthandler
import os
import select
import signal
import subprocess
import sys
import time

DUMP_SIGNAL = signal.SIGUSR2
# Time for the worker's signal handler to write its stacks before it is killed.
DUMP_WAIT_S = 2.0


class Watchdog:
    """The worker's side: arm(what, seconds) before a test item, disarm() after it."""

    def __init__(self, seconds: float, err):
        """``err``: a text file on the process's real stderr, where the stacks and the notice go."""
        self.seconds = seconds
        faulthandler.register(DUMP_SIGNAL, file=err, all_threads=True)
        self._proc = subprocess.Popen([sys.executable, __file__, str(os.getpid())], stdin=subprocess.PIPE,
                                      stdout=subprocess.DEVNULL, stderr=err, text=True, bufsize=1)

    def arm(self, what: str, seconds: float | None = None) -> None:
        self._send(f"arm {self.seconds if seconds is None else seconds} {what}")

    def disarm(self) -> None:
        self._send("disarm")

    def _send(self, line: str) -> None:
        try:
            self._proc.stdin.write(line.replace("\n", " ") + "\n")
            self._proc.stdin.flush()
        except (BrokenPipeError, ValueError):  # the watchdog process is gone: nothing left to tell
            pass


def _fire(worker: int, what: str, seconds: float) -> None:
    print(f"\n[test watchdog] {what} still running after {seconds:.0f} s: stacks of every thread "
          f"(SIGUSR2), then pytest process {worker} and its child processes killed", file=sys.stderr, flush=True)
    try:
        os.kill(worker, DUMP_SIGNAL)
    except OSError:
        return
    time.sleep(DUMP_WAIT_S)
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from pdkv.bench.ab.launch import descendants  # imported only now: nothing loaded while idle

    victims = [p for p in descendants(worker) if p != os.getpid()]  # listed before any dies
    for pid in reversed(victims):  # the worker last: its children are not orphaned before they are found
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass


def _serve(worker: int) -> None:
    deadline: float | None = None
    what, armed = "", 0.0
    buf = b""
    while True:
        wait = None if deadline is None else max(0.0, deadline - time.monotonic())
        ready, _, _ = select.select([0], [], [], wait)
        if ready:
            chunk = os.read(0, 65536)
            if not chunk:  # the worker exited
                return
            buf += chunk
            *lines, buf = buf.split(b"\n")
            for line in lines:
                cmd, _, rest = line.decode(errors="replace").partition(" ")
                if cmd == "arm":
                    secs, _, what = rest.partition(" ")
                    armed = float(secs)
                    deadline = time.monotonic() + armed
                elif cmd == "disarm":
                    deadline = None
        elif deadline is not None and time.monotonic() >= deadline:
            _fire(worker, what, armed)
            return


if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a ^C to the test run is the worker's to handle
    _serve(int(sys.argv[1]))
