#!/usr/bin/env python3
"""One-shot check of pdkv's GPU paths on a machine with an NVIDIA GPU (docs/GPU.md).

    python3 tools/gpu_check.py [--json gpu_check.json] [--only NAME ...] [--budget 450] [--dry-run]

From the repository root, no install step: the ``build`` check first builds pdkv's compiled
extensions in place with the interpreter it runs under (a fresh checkout has none, and one built
for another Python does not load), or is SKIP, with the checks that import them, where no C
compiler, Python headers or Cython exist; it never calls pip. The ``apis`` check then looks up
every torch / Triton / cuda-bindings API the GPU code calls. Prints the environment, one line
per check as it ends (``PASS`` / ``FAIL`` / ``SKIP``, a traceback after a FAIL), then a summary
with one line per check and ``N passed, N failed, N skipped``, and writes every result to one
JSON file (rewritten after every check).
Exit status: 0 when no check that should run failed, 1 otherwise. On a machine without a GPU
(no driver, or no device) it says "no GPU", marks every check SKIP and exits 0.

Checks run in order; those that need two processes on the GPU are skipped, with the reason,
when the compute mode is not Default; once ``--budget`` seconds have passed the rest are skipped
(the whole run is meant to stay under 8 minutes; FlashInfer's first JIT build is the slow part).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run from a checkout, no install
sys.path.insert(0, str(REPO / "tools"))

import gpu_check_apis as apis  # noqa: E402
import gpu_check_build as build  # noqa: E402
import gpu_check_devices as dev  # noqa: E402
import gpu_check_models as models  # noqa: E402
from gpu_check_models import SkipCheck as Skip  # noqa: E402


@dataclass(frozen=True)
class Check:
    name: str
    fn: Callable[[], object]  # returns a summary string, or (summary, data dict)
    # "multiprocess": two processes on the GPU; "pdkv._messenger" etc.: imports that extension
    needs: frozenset = frozenset()
    isolate: float | None = None  # run in a child process with this timeout (s): JIT builds, hangs


@dataclass
class Result:
    name: str
    status: str  # PASS | FAIL | SKIP
    seconds: float
    detail: str
    data: dict = field(default_factory=dict)


CHECKS = [
    Check("guard", dev.check_guard),
    Check("build", build.check_build),  # before anything imports pdkv._messenger / pdkv._kernels
    Check("apis", apis.check_apis),  # torch/triton/cuda-bindings here have what the checks call
    Check("compute-mode", dev.check_compute_mode),
    Check("cumem-2proc", dev.check_cumem_2proc, frozenset({"multiprocess"})),
    Check("cumem-views", dev.check_cumem_views),
    Check("kvcache", dev.check_kvcache),
    Check("bad-import", dev.check_bad_import),
    Check("dmabuf", dev.check_dmabuf),
    Check("gpudirect-host", dev.check_gpudirect_host),
    Check("counter", dev.check_counter),
    Check("counter-graph", dev.check_counter_graph_triton),
    Check("counter-graph-torch", dev.check_counter_graph_torch),
    Check("copy-engine", dev.check_copy_engine),
    Check("decode-roofline", models.check_decode_roofline),
    Check("decode-graphs", models.check_decode_graphs),  # the engine's decode under CUDA graphs, ~60 s
    Check("structured-masks", models.check_structured_masks),  # grammar masks applied on the device, ~10 s
    # a child process: the two nodes and the colocated reference share the GPU with nothing else of ours
    Check("disagg-gpu", models.check_disagg_gpu, frozenset({"multiprocess", "pdkv._messenger"}), isolate=300.0),
    # a prefill-like and a decode-like process on the GPU, shared vs split (parallel.gpu_sm_percent)
    Check("sm-split", models.check_sm_split, frozenset({"multiprocess"}), isolate=200.0),
    # model.share_weights on: the weights imported in a second process on the GPU, owner SIGKILLed
    Check("weights-ipc", models.check_weights_ipc, frozenset({"multiprocess"}), isolate=240.0),
    Check("flashinfer-parity", models.check_flashinfer_parity, isolate=300.0),  # its first JIT build is slow
    # after the parity check, whose JIT build it reuses (bf16, head_dim 128)
    Check("decode-graphs-flashinfer", models.check_decode_graphs_flashinfer, isolate=150.0),
]
CHECKS += __import__("gpu_check_fp8").checks(Check)  # FP8 GEMM and KV cache (tools/gpu_check_fp8.py)
# What --dry-run runs on a machine without a GPU: the build, the API lookup, and the same code as
# two GPU checks on the CPU stand-ins.
DRY_RUN = ("build", "apis", "decode-graphs", "disagg-gpu")


def run_one(check: Check) -> Result:
    t0 = time.monotonic()
    try:
        out = _isolated(check) if check.isolate else check.fn()
        detail, data = out if isinstance(out, tuple) else (out, {})
        return Result(check.name, "PASS", time.monotonic() - t0, str(detail), dict(data))
    except Skip as e:
        return Result(check.name, "SKIP", time.monotonic() - t0, str(e))
    except Exception as e:  # noqa: BLE001 - every check is reported; the exit status sums them up
        trace = traceback.format_exc(limit=8)
        print(trace, end="", flush=True)
        return Result(check.name, "FAIL", time.monotonic() - t0, f"{type(e).__name__}: {e}", {"traceback": trace})


def _isolated(check: Check):
    """Run one check in a child process (a hard time limit; a crash cannot take the run down)."""
    out_path = Path(os.environ.get("TMPDIR", "/tmp")) / f"pdkv-gpu-check-{os.getpid()}-{check.name}.json"
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", check.name, "--json", str(out_path)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=check.isolate)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"did not finish in {check.isolate:.0f} s (a first FlashInfer JIT build can take "
                             "minutes: pre-warm it, docs/GPU.md)") from None
    try:
        r = json.loads(out_path.read_text())["checks"][0]
    except (OSError, ValueError, KeyError, IndexError):
        raise AssertionError(f"the child process exited {proc.returncode} without a result: "
                             f"{(proc.stdout + proc.stderr)[-2000:]}") from None
    finally:
        out_path.unlink(missing_ok=True)
    if r["status"] == "SKIP":
        raise Skip(r["detail"])
    if r["status"] == "FAIL":
        raise AssertionError(f"{r['detail']}\n{r['data'].get('traceback', '')}")
    return r["detail"], r["data"]


def run_checks(checks: list[Check], budget: float, no_gpu: str | None = None,
               mode_problem: Callable[[], str | None] = lambda: None,
               on_result: Callable[[list[Result]], None] = lambda results: None) -> list[Result]:
    results: list[Result] = []
    t0 = time.monotonic()
    multiprocess = None
    for check in checks:
        skip = None
        if no_gpu is not None:
            skip = "no GPU on this machine"
        elif results and results[0].name == "guard" and results[0].status == "FAIL":
            skip = "the guard failed: nothing else can run"
        elif time.monotonic() - t0 > budget:
            skip = f"time budget of {budget:.0f} s used up (--budget)"
        else:
            if "multiprocess" in check.needs:
                multiprocess = mode_problem() if multiprocess is None else multiprocess
                skip = multiprocess or None
            if skip is None:
                skip = build.missing_for(check.needs, next((r for r in results if r.name == "build"), None))
        result = Result(check.name, "SKIP", 0.0, skip) if skip else run_one(check)
        if result.status == "SKIP" and check.name == "compute-mode" and no_gpu is None:
            multiprocess = result.detail
        results.append(result)
        print(_line(result), flush=True)
        on_result(results)
    return results


def _line(r: Result, width: int = 400) -> str:
    detail = r.detail.replace("\n", " ")
    return f"{r.status} {r.name} ({r.seconds:.1f}s): {detail[:width]}"


def summary(results: list[Result]) -> list[str]:
    counts = {s: sum(r.status == s for r in results) for s in ("PASS", "FAIL", "SKIP")}
    lines = ["", "summary:"] + [_line(r, 200) for r in results]
    lines.append(f"{counts['PASS']} passed, {counts['FAIL']} failed, {counts['SKIP']} skipped")
    return lines


def exit_code(results: list[Result]) -> int:
    return 1 if any(r.status == "FAIL" for r in results) else 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", default="gpu_check.json", help="where to write every result (default: %(default)s)")
    ap.add_argument("--only", nargs="+", metavar="NAME",
                    help="run only these checks (guard always runs, build when a check needs an extension)")
    ap.add_argument("--budget", type=float, default=450.0, help="skip checks that would start after this many seconds")
    ap.add_argument("--child", help=argparse.SUPPRESS)  # one isolated check, for _isolated
    ap.add_argument("--dry-run", action="store_true",
                    help=f"no GPU needed: run {', '.join(DRY_RUN)} on the CPU stand-ins (host KV, CPU copy engine)")
    args = ap.parse_args(argv)
    names = {c.name for c in CHECKS}
    for n in (args.only or []) + ([args.child] if args.child else []):
        if n not in names:
            ap.error(f"unknown check {n!r} (checks: {', '.join(c.name for c in CHECKS)})")
    started = time.time()
    if args.dry_run:  # the child processes (--child) inherit the device through the environment
        os.environ["PDKV_GPU_CHECK_DEVICE"] = "cpu"
    if args.child:
        checks, env, no_gpu = [c for c in CHECKS if c.name == args.child], {}, None
        checks = [Check(c.name, c.fn, c.needs) for c in checks]  # the child runs it in-process
    else:
        chosen = {c.name for c in CHECKS if not args.only or c.name in args.only} | {"guard"}
        if any(c.needs & set(build.EXTENSIONS) for c in CHECKS if c.name in chosen):
            chosen.add("build")
        checks = [c for c in CHECKS if c.name in chosen]
        env = dev.environment()
        for k, v in env.items():
            print(f"{k}: {v}")
        no_gpu = dev.no_gpu_reason()
        if args.dry_run:
            checks, no_gpu = [c for c in checks if c.name in DRY_RUN], None
            print(f"dry run: {', '.join(DRY_RUN)} on the CPU stand-ins")
        elif no_gpu is not None:
            print(f"no GPU: {no_gpu}; every check is skipped")

    def write(results: list[Result], complete: bool = False) -> None:
        # rewritten after every check: a run killed at its time limit still leaves its results
        report = {"started_unix": started, "seconds": time.time() - started, "host": platform.node(),
                  "environment": env, "no_gpu": no_gpu, "complete": complete,
                  "checks": [asdict(r) for r in results], "passed": sum(r.status == "PASS" for r in results),
                  "failed": sum(r.status == "FAIL" for r in results),
                  "skipped": sum(r.status == "SKIP" for r in results)}
        tmp = Path(f"{args.json}.tmp")
        tmp.write_text(json.dumps(report, indent=2, default=str) + "\n")
        tmp.replace(args.json)

    results = run_checks(checks, args.budget, no_gpu, dev.multiprocess_problem, on_result=write)
    if not args.child:
        print("\n".join(summary(results)), flush=True)
    write(results, complete=True)
    if not args.child:
        print(f"results: {Path(args.json).resolve()}")
    return exit_code(results)


if __name__ == "__main__":
    sys.exit(main())
