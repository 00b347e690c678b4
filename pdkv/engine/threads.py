"""Picks the torch thread count for CPU steps by measuring them.

A decode step of a few rows is bound by reading the weights. On an idle machine two threads
read faster than one; on a busy one (other processes on the cores) every one of a step's ~200
ops waits for the second thread to be scheduled, and one thread is several times faster
(measured on the 2-core dev box: 15 ms vs 60-95 ms per step). Neither choice is right
everywhere, so the runner asks this tuner: it keeps a moving average of small-step time per
candidate and uses the faster one, re-trying the other one now and then (that fresh sample
replaces its stale average, so a change of load is followed within one probe).

A probe of the slow choice is itself a stall of every running decode (on the busy 2-core box a
2-thread decode step took 0.9 s against 21 ms on one thread), so a probe that comes back more
than ``backoff_ratio`` x slower than the best doubles the wait before the next one, up to
``max_explore_every`` small steps; a probe that comes back close resets it.

Larger steps (prefill chunks, mixed prefill + decode steps) are not probed: a wrong guess there
costs seconds. They follow the small steps' verdict on whether the other cores are free
(``choose_large``): when every thread is more than ``contended_ratio`` x slower than one on a
small step, the other cores are busy, and a large step is slower on every thread too (measured
on the busy 2-core box, same run: 2 threads / 1 thread = 4.7x at 36 tokens, 7.4x at
132, 6.6x at 516, 3.2x at 1,504). Otherwise they use every thread.
"""

from __future__ import annotations


class ThreadTuner:
    def __init__(self, max_threads: int, explore_every: int = 64, alpha: float = 0.25,
                 max_explore_every: int = 1024, backoff_ratio: float = 2.0, contended_ratio: float = 1.5):
        self.candidates = sorted({1, max(1, max_threads)})
        self.explore_every, self.alpha = explore_every, alpha
        self.max_explore_every, self.backoff_ratio = max_explore_every, backoff_ratio
        self.contended_ratio = contended_ratio
        self.avg: dict[int, float] = {}
        self.num_steps = 0
        self._wait = explore_every  # small steps between probes (grows while probes lose big)
        self._last_probe = 0
        self._probe: int | None = None  # the candidate being re-tried this step, if any

    def choose(self) -> int:
        """The thread count for the next small step."""
        self.num_steps += 1
        for n in self.candidates:
            if n not in self.avg:
                return n
        best = min(self.candidates, key=self.avg.__getitem__)
        if len(self.candidates) > 1 and self.num_steps - self._last_probe >= self._wait:
            self._probe, self._last_probe = next(n for n in self.candidates if n != best), self.num_steps
            return self._probe
        return best

    def record(self, threads: int, seconds: float) -> None:
        old = self.avg.get(threads)
        if old is None or threads == self._probe:
            # A probe's old average is many steps stale: the fresh sample replaces it.
            if threads == self._probe:
                others = [v for n, v in self.avg.items() if n != threads]
                lost_big = bool(others) and seconds > self.backoff_ratio * min(others)
                self._wait = min(2 * self._wait, self.max_explore_every) if lost_big else self.explore_every
            self.avg[threads], self._probe = seconds, None
        else:
            self.avg[threads] = old + self.alpha * (seconds - old)

    def best(self) -> int:
        """The faster thread count on the small steps so far, without probing and not to be
        recorded: for steps a little larger than the tuned ones (a speculative verification's
        k + 1 rows), which are memory-bound too but cost more than a decode, so their times
        would bias the decode averages. Nothing measured yet: every thread."""
        measured = [n for n in self.candidates if n in self.avg]
        return min(measured, key=self.avg.__getitem__) if measured else self.candidates[-1]

    def choose_large(self) -> int:
        """The thread count for a compute-bound step: every thread, unless the small steps
        measured every thread more than ``contended_ratio`` x slower than one."""
        many = self.candidates[-1]
        one_s, many_s = self.avg.get(1), self.avg.get(many)
        if many == 1 or one_s is None or many_s is None:
            return many
        return 1 if many_s > self.contended_ratio * one_s else many
