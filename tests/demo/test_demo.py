"""`make demo` runs tools/demo.py: a newcomer's first command must work end to end."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow  # `make demo`'s cluster: ~35 s
def test_demo_streams_an_answer_through_a_local_cluster_and_stops_it(tmp_path):
    env = dict(os.environ, PDKV_CACHE_DIR=str(tmp_path / "cache"))  # nothing may come from a cache
    r = subprocess.run([sys.executable, str(ROOT / "tools" / "demo.py"), "--max-tokens", "8"],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    out = r.stdout
    assert r.returncode == 0, out + r.stderr
    lines = out.splitlines()
    serving = next(i for i, l in enumerate(lines) if l.startswith("pdkv up: serving"))
    first_rule = next(i for i, l in enumerate(lines) if l.startswith("-" * 72))
    assert serving < first_rule, out  # the cluster's ready line never lands inside the answer
    usage = json.loads(next(l for l in lines if l.startswith("demo: usage")).split(" ", 2)[2])
    assert 1 <= usage["completion_tokens"] <= 8 and usage["prompt_tokens"] > 1, usage  # EOS may end it
    rules = [i for i, l in enumerate(lines) if l.startswith("-" * 72)]
    assert "".join(lines[rules[0] + 1:rules[1]]).strip(), out  # the answer was printed
    assert lines[-1] == "demo: cluster stopped (status 0)", out
