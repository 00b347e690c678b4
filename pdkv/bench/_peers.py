"""Optional comparison peers for `pdkv.bench transfer`: NIXL (UCX, UCX_TLS=tcp) and Mooncake's
transfer engine (tcp, P2PHANDSHAKE), each over loopback with CPU memory.

They run as separate processes under `python` (which may be another venv, e.g. one where
`pip install --no-deps nixl-cu12==1.5.1 nixl==1.5.1` and `pip install
mooncake-transfer-engine-non-cuda` were done), so neither is ever imported into pdkv's own
process. A peer that is not importable there is skipped with a message, never an error.
"""
from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

HERE = Path(__file__).resolve().parent
PEERS = {
    "nixl": ("nixl._api", "_cmp_nixl.py", "pip install numpy && pip install --no-deps nixl-cu12==1.5.1 nixl==1.5.1"),
    "mooncake": ("mooncake.engine", "_cmp_mooncake.py", "pip install mooncake-transfer-engine-non-cuda"),
}


def run(name: str, sizes: list[int], seconds: float, python: str) -> dict[int, tuple[float, float]] | str:
    """{size: (GB/s, writes/s)}, or the reason the peer was skipped."""
    module, script, hint = PEERS[name]
    probe = subprocess.run([python, "-c", f"import os, {module}; os._exit(0)"], capture_output=True, text=True)
    if probe.returncode != 0:
        return f"skipped: {module} is not importable by {python} ({hint})"
    env = dict(os.environ, UCX_TLS="tcp")
    try:
        proc = subprocess.run([python, str(HERE / script), ",".join(map(str, sizes)), str(seconds)],
                              capture_output=True, text=True, timeout=600, env=env)
    except subprocess.TimeoutExpired:
        return "failed: timed out after 600 s"
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
        return f"failed (rc {proc.returncode}): {tail[0]}"
    return {int(k): tuple(v) for k, v in json.loads(lines[-1]).items()}
