"""Helpers of the A/B harness tests (importable as ``_abrun``): the trace slices, a CPU budget, a run."""
from __future__ import annotations

import os
from pathlib import Path

DATA = Path(__file__).parent / "data"
MOONCAKE = DATA / "mooncake_conversation_600s.jsonl"
AZURE = DATA / "azure_code_first40.csv"


def budget() -> str:
    """Two CPUs where the machine allows two (prefill on one, decode on the other), else one."""
    cpus = sorted(os.sched_getaffinity(0))[:2]
    return ",".join(map(str, cpus))


def run_ab(argv: list[str]) -> tuple[int, str]:
    """Run ``python -m pdkv.bench ab`` in this process; (exit status, stderr text)."""
    import contextlib
    import io

    from pdkv.bench.ab.cli import main

    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        rc = main(argv + ["--no-progress"])
    return rc, err.getvalue()
