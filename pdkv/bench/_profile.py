"""Where a decode step's CPU time goes, by part of the engine, from a cProfile of the steps
(`python -m pdkv.bench engine --profile`).

Every function's own time is given to the nearest part on its way up the call graph: a torch op
called from the attention backend is attention, the same op called from a norm is "layers". A
function called from several places splits its own time between them as cProfile measured it
per caller; further up, a caller's share follows its callers' cumulative times (gprof's rule).
"""

from __future__ import annotations

import pstats
from pathlib import PurePath

# (part, how a function is recognised), first match wins; functions matching none climb to
# their callers. NOTE: the GEMM fronts come first: they live beside the norms in cpu_kernels.py.
GEMM, ATTENTION, SAMPLER, SCHEDULER = "GEMMs", "attention", "sampler + logits", "scheduler"
LAYERS, RUNNER, OUTPUT, OTHER = "layers (norms, rope, glue)", "runner inputs", "engine outputs", "other"
PARTS = (GEMM, ATTENTION, LAYERS, SAMPLER, RUNNER, SCHEDULER, OUTPUT, OTHER)
_GEMM_FRONTS = {"linear", "gated_mlp", "bmm", "moe_one_token"}
_TORCH_GEMMS = {"<built-in method torch._C._nn.linear>", "<built-in method torch.matmul>",
                "<built-in method torch.bmm>", "<built-in method torch.addmm>"}


def part_of(func: tuple) -> str | None:
    """The part a profiled function (file, line, name) belongs to itself, or None (its callers')."""
    file, _, name = func
    if name in _TORCH_GEMMS:
        return None  # a torch GEMM is the part of its caller: attention's matmuls are attention
    parts = PurePath(file).parts
    if len(parts) < 2:
        return None
    pkg, mod = parts[-2], parts[-1]
    if mod == "cpu_kernels.py" and name in _GEMM_FRONTS:
        return GEMM
    if pkg == "attention" or mod in ("cpu_decode.py", "mla.py"):
        return ATTENTION
    if pkg == "engine" and mod in ("sampler.py", "logits.py", "structured.py"):
        return SAMPLER
    if (pkg == "engine" and mod in ("scheduler.py", "policy.py", "prefix_reuse.py")) or pkg == "kv":
        return SCHEDULER
    if pkg == "models" or (len(parts) > 2 and parts[-3] == "models"):
        return LAYERS
    if pkg == "engine" and mod in ("runner.py", "threads.py", "connector.py"):
        return RUNNER
    if (pkg == "engine" and mod in ("llm_engine.py", "request.py", "intake.py")) or mod == "detokenizer.py":
        return OUTPUT
    return None


def _linear_gemm(func: tuple, caller: tuple) -> bool:
    """A torch GEMM called straight from the GEMM fronts (their MKL fallback) or the LM head."""
    return func[2] in _TORCH_GEMMS and caller[2] in _GEMM_FRONTS | {"compute_logits"}


def by_part(stats: pstats.Stats) -> dict[str, float]:
    """Seconds of own CPU time per part (PARTS) over everything ``stats`` profiled."""
    table = stats.stats  # {func: (cc, nc, tt, ct, {caller: (cc, nc, tt, ct)})}
    memo: dict[tuple, dict[str, float]] = {}

    def shares(func: tuple, depth: int = 0) -> dict[str, float]:
        """{part: fraction} of ``func``'s time, by where it was called from."""
        if func in memo:
            return memo[func]
        own = part_of(func)
        if own is not None:
            return {own: 1.0}
        callers = table.get(func, (0, 0, 0, 0, {}))[4]
        total = sum(c[3] for c in callers.values())
        if depth > 64 or not callers or total <= 0:
            return {OTHER: 1.0}
        memo[func] = {OTHER: 1.0}  # a cycle back here ends as "other"
        out: dict[str, float] = {}
        for caller, c in callers.items():
            up = {GEMM: 1.0} if _linear_gemm(func, caller) else shares(caller, depth + 1)
            for part, f in up.items():
                out[part] = out.get(part, 0.0) + f * c[3] / total
        memo[func] = out
        return out

    seconds = dict.fromkeys(PARTS, 0.0)
    for func, (_, _, tt, _, callers) in table.items():
        if func[2] in _TORCH_GEMMS and callers:
            # split its own time by caller exactly (cProfile keeps each caller's own time)
            for caller, c in callers.items():
                up = {GEMM: 1.0} if _linear_gemm(func, caller) else shares(caller)
                for part, f in up.items():
                    seconds[part] += c[2] * f
            continue
        for part, f in shares(func).items():
            seconds[part] += tt * f
    return seconds


def print_parts(stats: pstats.Stats, b: int, steps: int) -> dict[str, float]:
    """Prints ms per step for each part; returns {part: ms per step}."""
    seconds = by_part(stats)
    total = sum(seconds.values()) or 1.0
    ms = {p: s / max(steps, 1) * 1e3 for p, s in seconds.items()}
    print(f"  parts B={b}: " + ", ".join(f"{p} {ms[p]:.2f} ms ({seconds[p] / total:.0%})"
                                       for p in PARTS if seconds[p] > 0))
    return ms
