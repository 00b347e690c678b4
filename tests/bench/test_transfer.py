"""`bench transfer`'s raw-socket baselines: the pool one receives every byte through a region it
wraps around many times (its own count is asserted by bench_raw), and the table prints both it
and the cache-hot one, with the target against the pool (no timing is asserted)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from pdkv.bench.transfer import bench_raw

ROOT = Path(__file__).resolve().parents[2]


def test_pool_baseline_wraps_its_region():
    # 64 writes of 64 KiB per stream through a 1 MiB pool: each socket's 512 KiB share wraps
    out = bench_raw([64 << 10, 256 << 10], 0.0001, 2, region=1 << 20)
    assert set(out) == {64 << 10, 256 << 10}
    assert all(gbs > 0 and writes > 0 for gbs, writes in out.values())


def test_table_prints_both_baselines():
    r = subprocess.run([sys.executable, "-m", "pdkv.bench", "transfer", "--no-peers", "--sizes", "64K",
                        "--seconds", "0.001"], cwd=ROOT, env=dict(os.environ), capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "raw-2 hot" in r.stdout and "raw-2 pool" in r.stdout, r.stdout
    row = next(ln.split() for ln in r.stdout.splitlines() if ln.strip().startswith("64K"))
    assert float(row[4]) > 0 and float(row[6]) > 0  # the hot and the pool GB/s
    assert "x raw-2 pool at >= 64K" in r.stdout
