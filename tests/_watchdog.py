"""The suite's last resort against a test that hangs where pytest-timeout cannot reach it.

pytest-timeout's signal method raises in the main thread when it next runs Python: a test stuck
inside C (a nogil poll loop, a join in an extension's teardown, a blocking read with the GIL
released) never does, and its xdist worker then holds the whole run until CI's own limit, with
nothing printed about where. This watchdog runs in its own thread with its own deadline per test
item (setup, call and teardown together, a margin past pytest-timeout's): when one passes it
prints every thread's stack, kills the processes the worker started (node processes, peers) so
nothing outlives it, and exits the worker. xdist reports that test as crashed and goes on with
a fresh worker. faulthandler's C-level timer backs it up for a hang that holds the GIL.
"""
from __future__ import annotations

import faulthandler
import os
import signal
import threading
import time


def descendants(root: int) -> list[int]:
    """Every live process below ``root`` by parent links, deepest first (from /proc/*/stat)."""
    parent: dict[int, int] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                parent[int(name)] = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue  # gone meanwhile
    children: dict[int, list[int]] = {}
    for pid, ppid in parent.items():
        children.setdefault(ppid, []).append(pid)
    out, todo = [], [root]
    while todo:
        for c in children.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out[::-1]


class Watchdog:
    def __init__(self, seconds: float, err, grace: float = 60.0):
        """``err``: a text file on the process's real stderr, where the stacks go."""
        self.seconds, self.err, self.grace = seconds, err, grace
        self._cv = threading.Condition()
        self._deadline: float | None = None
        self._what = ""
        threading.Thread(target=self._run, name="test-watchdog", daemon=True).start()

    def arm(self, what: str, seconds: float | None = None) -> None:
        seconds = self.seconds if seconds is None else seconds
        with self._cv:
            self._deadline, self._what = time.monotonic() + seconds, what
            self._cv.notify()
        faulthandler.dump_traceback_later(seconds + self.grace, exit=True, file=self.err)

    def disarm(self) -> None:
        faulthandler.cancel_dump_traceback_later()
        with self._cv:
            self._deadline = None
            self._cv.notify()

    def _run(self) -> None:
        with self._cv:
            while True:
                if self._deadline is None:
                    self._cv.wait()
                    continue
                left = self._deadline - time.monotonic()
                if left > 0:
                    self._cv.wait(left)
                    continue
                self._fire(self._what)

    def _fire(self, what: str) -> None:
        err = self.err
        print(f"\n[test watchdog] {what} still running after {self.seconds:.0f} s: stacks of every "
              f"thread, then its child processes killed and this pytest process ({os.getpid()}) ended",
              file=err, flush=True)
        faulthandler.dump_traceback(file=err, all_threads=True)
        for pid in descendants(os.getpid()):
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        err.flush()
        os._exit(3)
