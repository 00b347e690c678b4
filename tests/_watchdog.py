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

from pdkv.bench.ab.launch import descendants


class Watchdog:
    def __init__(self, seconds: float, err, grace: float = 60.0):
        """``err``: a text file on the process's real stderr, where the stacks go."""
        self.seconds, self.err, self.grace = seconds, err, grace
        self._cv = threading.Condition()
        self._deadline: float | None = None
        self._what, self._armed_s = "", seconds
        threading.Thread(target=self._run, name="test-watchdog", daemon=True).start()

    def arm(self, what: str, seconds: float | None = None) -> None:
        seconds = self.seconds if seconds is None else seconds
        with self._cv:
            self._deadline, self._what, self._armed_s = time.monotonic() + seconds, what, seconds
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
                self._fire(self._what, self._armed_s)

    def _fire(self, what: str, seconds: float) -> None:
        err = self.err
        print(f"\n[test watchdog] {what} still running after {seconds:.0f} s: stacks of every "
              f"thread, then its child processes killed and this pytest process ({os.getpid()}) ended",
              file=err, flush=True)
        faulthandler.dump_traceback(file=err, all_threads=True)
        me = os.getpid()
        for pid in descendants(me):
            if pid == me:
                continue
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        err.flush()
        os._exit(3)
