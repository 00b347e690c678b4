"""Picks the torch thread count for small CPU steps by measuring them.

A decode step of a few rows is bound by reading the weights. On an idle machine two threads
read faster than one; on a busy one (other processes on the cores) every one of a step's ~200
ops waits for the second thread to be scheduled, and one thread is several times faster
(measured on the 2-core dev box: 15 ms vs 60-95 ms per step). Neither choice is right
everywhere, so the runner asks this tuner: it keeps a moving average of step time per candidate
and uses the faster one, re-trying the other one step in ``explore_every`` (that fresh sample
replaces its stale average, so a change of load is followed within one probe).
"""

from __future__ import annotations


class ThreadTuner:
    def __init__(self, max_threads: int, explore_every: int = 64, alpha: float = 0.25):
        self.candidates = sorted({1, max(1, max_threads)})
        self.explore_every, self.alpha = explore_every, alpha
        self.avg: dict[int, float] = {}
        self.num_steps = 0
        self._probe: int | None = None  # the candidate being re-tried this step, if any

    def choose(self) -> int:
        """The thread count for the next small step."""
        self.num_steps += 1
        for n in self.candidates:
            if n not in self.avg:
                return n
        best = min(self.candidates, key=self.avg.__getitem__)
        if len(self.candidates) > 1 and self.num_steps % self.explore_every == 0:
            self._probe = next(n for n in self.candidates if n != best)
            return self._probe
        return best

    def record(self, threads: int, seconds: float) -> None:
        old = self.avg.get(threads)
        if old is None or threads == self._probe:
            # A probe's old average is explore_every steps stale: the fresh sample replaces it.
            self.avg[threads], self._probe = seconds, None
        else:
            self.avg[threads] = old + self.alpha * (seconds - old)
