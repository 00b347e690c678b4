"""Micro-benchmarks of the per-step, per-page and per-request hot paths (pytest-benchmark).

Collected only when asked (see tests/conftest.py): ``make bench-micro`` runs

    pytest --benchmark-only --benchmark-autosave --benchmark-compare benchmarks/micro

Each benchmark asserts that what it timed is correct, and records in ``extra_info`` how often
its call runs in one worst-case decode step of the benchmark model (64 running requests) and
the share of that step it may take (``budget_pct``). After the run this file prints two tables:

- change per benchmark against the previous saved run (min and median), or a line saying there
  is nothing to compare with on a first run;
- each path's cost per step as a share of the decode step measured in the same run
  (``test_decode_step``), against its budget.

The numbers are never asserted: a benchmark is not a timed test (STYLE.md).
"""

from __future__ import annotations

import os

import pytest

DECODE_STEP = "test_decode_step"


@pytest.fixture
def budget(benchmark):
    """budget(unit=, per_step=, budget_pct=, per_step_b1=None): how often the benchmarked call
    runs in one decode step of 64 requests, the share of that step it may take, and (for paths
    whose count does not grow with the batch: per-request ones) how often in a step of one."""

    def record(*, unit: str, per_step: float, budget_pct: float, per_step_b1: float | None = None) -> None:
        benchmark.extra_info.update(unit=unit, per_step=per_step, budget_pct=budget_pct,
                                    per_step_b1=per_step_b1)
    return record


@pytest.fixture(scope="session")
def bench_threads() -> int:
    return len(os.sched_getaffinity(0))


def _name(fullname: str) -> str:
    return fullname.split("::")[-1]


def _fmt(seconds: float) -> str:
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("us", 1e-6)):
        if seconds >= scale:
            return f"{seconds / scale:8.2f} {unit}"
    return f"{seconds / 1e-9:8.1f} ns"


def _change_table(session, write) -> None:
    now = {b.fullname: b.stats for b in session.benchmarks if b}
    if not session.compared_mapping:
        saved = "this run is saved as the baseline for the next one" if (session.save or session.autosave) \
            else "save one with --benchmark-autosave"
        write(f"no previous saved run to compare with (first run, or none in {session.storage}): {saved}")
        return
    [(path, prev)] = list(session.compared_mapping.items())[-1:]
    write(f"change against {os.path.basename(str(path))} (negative = faster now)")
    write(f"{'benchmark':<48} {'min before':>12} {'min now':>12} {'change':>8} "
          f"{'median before':>14} {'median now':>12} {'change':>8}")
    for name, st in sorted(now.items()):
        old = prev.get(name)
        if old is None:
            write(f"{_name(name):<48} {'(new)':>12} {_fmt(st.min):>12}")
            continue
        o = old["stats"]
        write(f"{_name(name):<48} {_fmt(o['min']):>12} {_fmt(st.min):>12} {st.min / o['min'] - 1:+8.1%} "
              f"{_fmt(o['median']):>14} {_fmt(st.median):>12} {st.median / o['median'] - 1:+8.1%}")


def _budget_table(session, write) -> None:
    benches = [b for b in session.benchmarks if b]
    steps = {b.extra_info.get("batch"): b.stats.median for b in benches
             if _name(b.fullname).startswith(DECODE_STEP)}
    if not steps:
        write(f"no {DECODE_STEP} in this run: no per-step budget table")
        return
    big = max(steps)
    step_s, one_s = steps[big], steps.get(1)
    write(f"per-step cost against the decode steps of this run (medians): B={big} {_fmt(step_s).strip()}"
          + (f", B=1 {_fmt(one_s).strip()}" if one_s else ""))
    write(f"{'benchmark':<48} {'per call':>12} {'calls/step':>10} {'per step':>12} {f'of B={big}':>8} "
          f"{'budget':>7}      {'of B=1':>8}  unit")
    for b in sorted(benches, key=lambda b: b.fullname):
        info = b.extra_info
        if "per_step" not in info:
            continue
        per_step = b.stats.median * info["per_step"]
        share = per_step / step_s
        ok = "ok" if share * 100 <= info["budget_pct"] else "OVER"
        b1 = info.get("per_step_b1")
        one = f"{b.stats.median * b1 / one_s:>8.3%}" if b1 is not None and one_s else f"{'-':>8}"
        write(f"{_name(b.fullname):<48} {_fmt(b.stats.median):>12} {info['per_step']:>10g} "
              f"{_fmt(per_step):>12} {share:>8.3%} {info['budget_pct']:>6g}% {ok:<4} {one}  {info['unit']}")


@pytest.hookimpl(trylast=True)
def pytest_terminal_summary(terminalreporter, config):
    session = getattr(config, "_benchmarksession", None)
    if session is None or not any(session.benchmarks):
        return
    terminalreporter.section("pdkv micro-benchmarks")
    _change_table(session, terminalreporter.write_line)
    terminalreporter.write_line("")
    _budget_table(session, terminalreporter.write_line)
