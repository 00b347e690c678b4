"""Per-step timing for the interference benchmark: where one engine step's time goes.

``PartClock.install(engine)`` wraps a few of the engine's bound methods (instance attributes
only: the classes, and every other engine, stay untouched) so that each call adds its time to a
named part; ``take()`` returns and resets the totals after a step. On the CPU every op is
synchronous, so a wall-clock interval around a call is that call's compute time.

Parts (ms per step), each measured, not apportioned:
  attn.decode   rows of the batched path attending over their cached KV (the torch backend's
                ``_decode``): decodes, verifications, and later chunks of at most
                models.attention.torch_backend.MULTI_QUERY_MAX tokens
  attn.cached   a longer later chunk reading its earlier chunks' KV from the pages (``_gather``)
  attn.chunk    a chunk's attention kernel over [cached | new] keys (``_prefill`` minus the read)
  kv.write      the step's new K/V into their pages (with the CPU decode kernel, a decode-only
                step's write is inside its one attn.decode call)
  dense         q/k/v and o projections, rope (attention block minus the backend)
  mlp           the gated MLPs
  sample        LM head on the sampled rows + the sampler
  book          everything else in ``LLMEngine.step``: schedule, plan, tensors, norms, outputs
"""

from __future__ import annotations

import time
from collections import defaultdict

PARTS = ("attn.decode", "attn.cached", "attn.chunk", "kv.write", "dense", "mlp", "sample", "book")


class PartClock:
    def __init__(self):
        self._t: dict[str, float] = defaultdict(float)
        self.last_seqs: list = []  # the ScheduledSeqs of the latest step

    def _wrap(self, obj, attr: str, name: str) -> None:
        fn = getattr(obj, attr)

        def timed(*args, **kw):
            start = time.perf_counter()
            try:
                return fn(*args, **kw)
            finally:
                self._t[name] += time.perf_counter() - start

        setattr(obj, attr, timed)

    def install(self, engine) -> None:
        runner = engine.runner
        backend, model = runner.backend, runner.model
        for attr, name in (("_decode", "decode"), ("_gather", "gather"), ("_prefill", "prefill"),
                           ("_write", "write"), ("forward", "backend")):
            if hasattr(backend, attr):  # other backends: only their forward is split out
                self._wrap(backend, attr, name)
        for layer in model.model.layers:
            self._wrap(layer.self_attn, "forward", "attn_block")
            self._wrap(layer.mlp, "forward", "mlp")
        self._wrap(model, "forward", "forward")
        self._wrap(model, "compute_logits", "logits")
        self._wrap(runner, "sampler", "sampler")
        execute = runner.execute

        def recording(seqs, *args, **kw):  # execute(seqs, connector)
            self.last_seqs = list(seqs)
            return execute(seqs, *args, **kw)

        runner.execute = recording

    def take(self, step_seconds: float) -> dict[str, float]:
        """This step's parts in ms (see the module docstring); resets the totals."""
        t, self._t = self._t, defaultdict(float)
        ms = {k: v * 1e3 for k, v in t.items()}
        g = ms.get
        parts = {
            "attn.decode": g("decode", 0.0),
            "attn.cached": g("gather", 0.0),
            "attn.chunk": g("prefill", 0.0) - g("gather", 0.0),
            "kv.write": g("write", 0.0),
            "dense": g("attn_block", 0.0) - g("backend", 0.0),
            "mlp": g("mlp", 0.0),
            "sample": g("logits", 0.0) + g("sampler", 0.0),
        }
        parts["book"] = step_seconds * 1e3 - sum(parts.values())
        return parts


def percentile(xs: list[float], q: float) -> float:
    """The q-th percentile (0..100) with linear interpolation, as numpy's default."""
    if not xs:
        return float("nan")
    s = sorted(xs)
    pos = (len(s) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)
