"""Rate-limited logging of repeated errors: a flood of bad connections or messages must not
become a flood of log lines (a remote party could otherwise fill the disk and burn a core).

Per key, the first message in each ``interval`` s is logged; the ones suppressed meanwhile are
counted and reported with the next one that gets through.
"""

from __future__ import annotations

import logging
import time


class RateLimitedLog:
    def __init__(self, logger: logging.Logger, interval: float = 10.0, max_keys: int = 1024):
        self.logger, self.interval, self.max_keys = logger, interval, max_keys
        self._last: dict[str, tuple[float, int]] = {}  # key -> (last logged, suppressed since)

    def warning(self, key: str, fmt: str, *args) -> bool:
        """Log ``fmt % args`` unless ``key`` was logged within the interval; True if it was logged."""
        now = time.monotonic()
        last, suppressed = self._last.get(key, (float("-inf"), 0))
        if now - last < self.interval:
            self._last[key] = (last, suppressed + 1)
            return False
        if len(self._last) >= self.max_keys and key not in self._last:  # bounded: forget the oldest
            self._last.pop(next(iter(self._last)))
        self._last[key] = (now, 0)
        if suppressed:
            fmt += " (%d similar message(s) suppressed in the last %.0f s)"
            args = (*args, suppressed, self.interval)
        self.logger.warning(fmt, *args)
        return True
