"""`python -m pdkv.bench transfer --transport verbs` takes --nic (it used to fail at once with
"exactly one NIC name is supported per transport, got 0"); here over the loopback device."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _bench(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pdkv.bench", "transfer", "--no-peers", "--sizes", "4K",
                           "--seconds", "0.001", *args], cwd=ROOT, env={**os.environ, **(env or {})},
                          capture_output=True, text=True, timeout=120)


def test_verbs_bench_runs_on_the_named_nic(loopback_verbs_dir):
    from pdkv._messenger import HAVE_VERBS

    if not HAVE_VERBS:
        pytest.skip("pdkv built without libibverbs")
    r = _bench("--transport", "verbs", "--nic", "lo_verbs0", env={"LD_LIBRARY_PATH": loopback_verbs_dir})
    assert r.returncode == 0, r.stderr[-2000:]
    assert "pdkv transfer benchmark: verbs" in r.stdout
    row = [ln.split() for ln in r.stdout.splitlines() if ln.strip().startswith("4K")]
    assert row and float(row[0][1]) > 0, r.stdout  # a measured rate for 4 KiB pages


def test_verbs_bench_without_a_nic_says_what_is_missing():
    r = _bench("--transport", "verbs")
    assert r.returncode != 0 and "--nic" in r.stderr, r.stderr[-2000:]


def test_libfabric_bench_measures_tcp_beside_it():
    from pdkv._messenger import HAVE_LIBFABRIC

    if not HAVE_LIBFABRIC and os.environ.get("PDKV_REQUIRE_LIBFABRIC") != "1":
        pytest.skip("pdkv built without libfabric")
    r = _bench("--transport", "libfabric", "--provider", "tcp;ofi_rxm")
    assert r.returncode == 0, r.stderr[-2000:]
    assert "libfabric provider tcp;ofi_rxm, domain ['lo']" in r.stdout, r.stdout
    rows = [ln.split() for ln in r.stdout.splitlines() if ln.strip().startswith("4K")]
    # both measured: writes per second (a GB/s column rounds a slow run on a loaded machine to 0.00)
    assert len(rows) == 2 and float(rows[1][2]) > 0 and float(rows[1][4]) > 0, r.stdout
