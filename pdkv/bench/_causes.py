"""`python -m pdkv.bench interference --causes`: the two measurements behind the fix of
chunked prefill's decode stalls.

1. SDPA kernels for a later chunk (q_len < kv_len) on the default model's head shape: the old
   3-D call with a [group * n, L] mask (PyTorch's math kernel) against the 4-D ``enable_gqa``
   call with an [n, L] mask (the fused kernel), and the dispatcher's choice for each.
2. Step time on 1 thread and on every thread, interleaved in the same run, for hand-built steps
   of 4 decodes plus a chunk of 0-1,500 tokens (``ModelRunner.execute`` with the thread count
   forced), so the busy-cores penalty is seen per step size.
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.nn.functional as F


def _best_ms(fn, reps: int = 5) -> float:
    fn()
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best * 1e3


def sdpa_paths(kv_heads: int = 4, group: int = 2, head_dim: int = 32) -> None:
    torch.set_num_threads(1)
    print("SDPA for one later chunk, one layer, 1 thread (best of 5):")
    for n, L in ((512, 1024), (476, 1500), (128, 1500), (128, 4000)):
        q = torch.randn(n, kv_heads * group, head_dim)
        k, v = torch.randn(kv_heads, L, head_dim), torch.randn(kv_heads, L, head_dim)
        mask = torch.arange(L)[None] <= torch.arange(L - n, L)[:, None]  # [n, L]
        q3 = q.view(n, kv_heads, group, head_dim).permute(1, 2, 0, 3).reshape(kv_heads, group * n, head_dim)
        m3 = mask.repeat(group, 1)
        q4 = q.transpose(0, 1)[None]
        old = (q3, k, v), {"attn_mask": m3}
        new = (q4, k[None], v[None]), {"attn_mask": mask, "enable_gqa": True}
        cells = []
        for name, (args, kw) in (("3-D (old)", old), ("4-D gqa (new)", new)):
            choice = torch._fused_sdp_choice(*args, **kw) if hasattr(torch, "_fused_sdp_choice") else -1
            ms = _best_ms(lambda: F.scaled_dot_product_attention(*args, **kw))
            cells.append(f"{name} {ms:6.1f} ms (kernel {torch.nn.attention.SDPBackend(choice).name if choice >= 0 else '?'})")
        print(f"  n={n:4d} L={L:4d}: " + "  ".join(cells))


def thread_ratios(engine, reps: int = 3) -> None:
    from pdkv.engine.request import Request
    from pdkv.engine.scheduler import ScheduledSeq
    import pdkv.engine.runner as runner_mod

    runner, many = engine.runner, engine.runner.num_threads
    # Requests of our own with their pages (nothing else in the engine is touched): 4 decodes at
    # position 24, and one prompt whose chunks run from kv 0 or 1024.
    decodes = [Request(f"causes-d{i}", [1] * 25, None, None) for i in range(4)]
    pre = Request("causes", [1] * 1600, None, None)
    for r in (*decodes, pre):
        r.pages = engine.allocator.allocate(engine.scheduler.pages_for(r.num_prompt_tokens))
    saved = runner_mod.SMALL_STEP_TOKENS, runner.tuner.choose_large
    shapes = ((0, 0), (32, 0), (128, 0), (128, 1024), (512, 0), (512, 1024), (1500, 0))
    times: dict[tuple, list[float]] = {}
    try:
        for _ in range(reps):
            for n, start in shapes:
                for threads in (1, many):
                    runner_mod.SMALL_STEP_TOKENS = 0  # every step asks choose_large: force it
                    runner.tuner.choose_large = lambda t=threads: t
                    seqs = [ScheduledSeq(r, [1], 24, False) for r in decodes]
                    if n:
                        seqs.append(ScheduledSeq(pre, [1] * n, start, False))
                    t = time.perf_counter()
                    runner.execute(seqs, engine.connector)
                    times.setdefault((n, start, threads), []).append((time.perf_counter() - t) * 1e3)
    finally:
        runner_mod.SMALL_STEP_TOKENS, runner.tuner.choose_large = saved
        for r in (*decodes, pre):
            engine.allocator.free(r.pages)
    print(f"step time, {len(decodes)} decodes + a chunk, 1 vs {many} threads interleaved (median of {reps}):")
    for n, start in shapes:
        one, all_ = (statistics.median(times[(n, start, t)]) for t in (1, many))
        print(f"  chunk {n:4d} from kv {start:4d}: 1 thread {one:7.1f} ms, {many} threads {all_:7.1f} ms, "
              f"ratio {all_ / one:5.2f}")
