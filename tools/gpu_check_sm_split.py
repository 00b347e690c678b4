"""gpu_check's SM split (``sm-split``): two role processes on one GPU, a prefill-like one (large
GEMMs back to back) and a decode-like one (small steps, each synchronized and timed), first
sharing every SM, then split by ``parallel.gpu_sm_percent`` (pdkv/gpu/sm_split.py: MPS when
its daemon runs, else green contexts) -- the decode one at ``DECODE_PERCENT``, the prefill one at
the rest. Reported: the decode step's p50 / p99 ms and the prefill's TFLOP/s in both runs, and
the mechanism used. PASS when both runs complete and the split run used a mechanism; the
numbers are the measurement (the decode tail under a split is what it is for).

The workloads are the two roles' shapes, not the engine (the disaggregated engine pair on one
GPU is ``disagg-gpu``); each worker goes through sm_split.probe / apply / enter_current_thread,
the code a node runs. ``python tools/gpu_check_sm_split.py`` runs it alone.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DECODE_PERCENT = 30
SECONDS = 6.0


def _worker(role: str, percent: int, device: str, seconds: float) -> dict:
    """One role process's loop (run as ``python gpu_check_sm_split.py --worker ...``)."""
    from pdkv.gpu import sm_split

    split = sm_split.probe(device, percent)
    sm_split.apply(split, device)  # MPS: before torch touches CUDA below
    import torch

    green = sm_split.enter_current_thread()  # this thread launches every kernel here
    dev = torch.device(device)
    n = 8192 if role == "prefill" else 1024
    rows = 4096 if role == "prefill" else 8
    w = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
    x = torch.randn(rows, n, device=dev, dtype=torch.bfloat16)
    torch.cuda.synchronize()
    steps, times, t_end = 0, [], time.perf_counter() + seconds
    t0 = time.perf_counter()
    while time.perf_counter() < t_end:
        s = time.perf_counter()
        for _ in range(1 if role == "prefill" else 16):  # a decode step: 16 small layers
            y = x @ w
        torch.cuda.synchronize()
        times.append(time.perf_counter() - s)
        steps += 1
    wall = time.perf_counter() - t0
    times.sort()
    out = {"role": role, "mechanism": split.mechanism, "num_sms": split.num_sms, "steps": steps,
           "p50_ms": 1e3 * times[len(times) // 2], "p99_ms": 1e3 * times[min(len(times) - 1, int(0.99 * len(times)))]}
    if role == "prefill":
        out["tflops"] = 2 * rows * n * n * steps / wall / 1e12
    del green, y
    return out


def _pair(device: str, split: bool, seconds: float) -> dict:
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    procs = {}
    for role, pct in (("prefill", 100 - DECODE_PERCENT), ("decode", DECODE_PERCENT)):
        procs[role] = subprocess.Popen([sys.executable, __file__, "--worker", role, str(pct if split else 0), device,
                                        str(seconds)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env,
                                       text=True)
    out = {}
    for role, p in procs.items():
        so, se = p.communicate(timeout=seconds + 120)
        if p.returncode != 0:
            raise RuntimeError(f"{role} worker failed ({p.returncode}): {se.strip()[-800:]}")
        out[role] = json.loads(so.strip().splitlines()[-1])
    return out


def run_sm_split(device: str = "cuda", seconds: float = SECONDS) -> tuple[str, dict]:
    from gpu_check_models import SkipCheck  # noqa: PLC0415 - tools/ is on sys.path (gpu_check.py)
    from pdkv.gpu import sm_split

    try:  # in this process only to learn whether a split can be made (the workers decide for themselves)
        mech = sm_split.probe(device, DECODE_PERCENT).mechanism
    except sm_split.SMSplitError as e:
        raise SkipCheck(str(e)) from None
    whole, split = _pair(device, False, seconds), _pair(device, True, seconds)
    if split["decode"]["mechanism"] == "none":
        raise RuntimeError(f"the split run used no mechanism (probe here said {mech})")
    d0, d1, p0, p1 = whole["decode"], split["decode"], whole["prefill"], split["prefill"]
    summary = (f"{d1['mechanism']} ({DECODE_PERCENT}% decode): decode step p50 {d0['p50_ms']:.2f} -> "
               f"{d1['p50_ms']:.2f} ms, p99 {d0['p99_ms']:.2f} -> {d1['p99_ms']:.2f} ms; prefill "
               f"{p0['tflops']:.0f} -> {p1['tflops']:.0f} TFLOP/s (whole GPU shared -> split)")
    return summary, {"whole": whole, "split": split}


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        print(json.dumps(_worker(sys.argv[2], int(sys.argv[3]), sys.argv[4], float(sys.argv[5]))))
    else:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        print(run_sm_split(os.environ.get("PDKV_GPU_CHECK_DEVICE", "cuda")))
