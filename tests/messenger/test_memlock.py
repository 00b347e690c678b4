"""The locked-memory check a verbs node runs at start-up before it registers its KV cache."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from pdkv._messenger import check_lockable, locked_memory_limit

ROOT = Path(__file__).resolve().parents[2]
PROBE = ("from pdkv._messenger import check_lockable, locked_memory_limit\n"
         "print(locked_memory_limit())\n"
         "try:\n    check_lockable(1 << 30)\n    print('ok')\n"
         "except Exception as e:\n    print(type(e).__name__, e)\n")


def test_no_limit_means_none_and_no_error():
    limit = locked_memory_limit()
    assert limit is None or limit > 0
    check_lockable(0)
    if limit is None:
        check_lockable(1 << 40)  # nothing to refuse


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("capsh"), reason="needs root and capsh to drop CAP_IPC_LOCK")
def test_a_low_limit_without_cap_ipc_lock_is_a_clear_error():
    # without CAP_IPC_LOCK and with `ulimit -l 64` (KiB), 1 GiB cannot be pinned: say so and how to fix it
    r = subprocess.run(["capsh", "--drop=cap_ipc_lock", "--", "-c", f"ulimit -l 64; exec {sys.executable} -c \"$0\"", PROBE],
                       cwd=ROOT, env=os.environ, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    limit, verdict = r.stdout.splitlines()[:2]
    assert limit == str(64 << 10)
    assert verdict.startswith("TransportUnavailableError") and "ulimit -l unlimited" in verdict and "CAP_IPC_LOCK" in verdict
