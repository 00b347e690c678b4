"""SLO-aware admission on a decode node (``server.admission: shed``, ``server.ttft_slo_ms``).

A prompt that would be prefilled remotely is expected to wait for what the chosen prefill node
has queued plus its own uncached tokens, at the rate this node measures: every transfer that
lands is one sample of seconds per prompt token (PREFILL sent -> every page landed, over the
tokens sent; it includes the queueing the node saw, so a loaded prefill node reads slower). With
no sample yet nothing is shed. Expected time over the budget: the prompt is prefilled here when
the prefill chooser allows it (``disagg.local_fallback``), else it is answered at once with a
503 and a Retry-After of the time the budget is short by — never queued past its budget.
"""

from __future__ import annotations

import math
import threading

ALPHA = 0.2  # weight of the newest sample


class TTFTEstimator:
    def __init__(self, slo_ms: float | None, mode: str):
        self.slo_s = None if slo_ms is None else slo_ms / 1000.0
        self.shed = mode == "shed" and slo_ms is not None
        self._s_per_token: float | None = None
        self._lock = threading.Lock()  # samples on the event loop, reads on the engine thread

    def observe(self, num_tokens: int, seconds: float) -> None:
        if num_tokens <= 0 or seconds <= 0:
            return
        x = seconds / num_tokens
        with self._lock:
            self._s_per_token = x if self._s_per_token is None else (1 - ALPHA) * self._s_per_token + ALPHA * x

    def expected_s(self, tokens_ahead: int) -> float | None:
        with self._lock:
            return None if self._s_per_token is None else tokens_ahead * self._s_per_token

    def over_budget(self, tokens_ahead: int) -> float | None:
        """Seconds the expected TTFT exceeds the budget by (shed mode), or None when within it."""
        if not self.shed:
            return None
        est = self.expected_s(tokens_ahead)
        if est is None or est <= self.slo_s:
            return None
        return est - self.slo_s

    @staticmethod
    def retry_after(short_by_s: float) -> int:
        return max(1, math.ceil(short_by_s))
