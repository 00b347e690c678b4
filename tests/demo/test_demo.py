"""`make demo` runs tools/demo.py: a newcomer's first command must work end to end."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_demo_streams_an_answer_through_a_local_cluster_and_stops_it(tmp_path):
    env = dict(os.environ, PDKV_CACHE_DIR=str(tmp_path / "cache"))  # builds the default model fresh
    r = subprocess.run([sys.executable, str(ROOT / "tools" / "demo.py"), "--max-tokens", "8"],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    out = r.stdout
    assert r.returncode == 0, out + r.stderr
    lines = out.splitlines()
    serving = next(i for i, l in enumerate(lines) if l.startswith("pdkv up: serving"))
    first_rule = next(i for i, l in enumerate(lines) if l.startswith("-" * 72))
    assert serving < first_rule, out  # the cluster's ready line never lands inside the answer
    usage = json.loads(next(l for l in lines if l.startswith("demo: usage")).split(" ", 2)[2])
    assert usage["completion_tokens"] == 8 and usage["prompt_tokens"] > 1, usage
    assert lines[-1] == "demo: cluster stopped (status 0)", out
