"""--fault: the prefill node of a disaggregated architecture is SIGKILLed mid-replay and
restarted; the requests it took down fail with a clear error, every other request completes with
all its tokens, the decode node reconnects, and every page pool returns to its start."""
from __future__ import annotations

import json

import pytest

from _abrun import MOONCAKE, budget, run_ab


@pytest.mark.slow  # a ~27 s replay and a restart: ~35 s
def test_prefill_node_killed_and_restarted_mid_replay(tiny_model_dir, tmp_path):
    # 40 requests over ~27 s: some in flight at the kill (1 s), some during the outage (the
    # restart loads torch and the model again: ~20 s on a loaded 2-core machine), and the rest
    # after the node is back
    rc, err = run_ab(["--trace", str(MOONCAKE), "--length-scale", "0.01", "--output-scale", "0.05",
                      "--rate", "1.5", "--model", str(tiny_model_dir), "--cpus", budget(), "--archs", "disagg",
                      "--fault", "prefill@1.0", "--out", str(tmp_path), "--no-plots",
                      "--set", "messenger.lease_s=2.0", "--set", "messenger.heartbeat_s=0.2"])
    assert rc == 0, err
    rep = json.loads((tmp_path / "report.json").read_text())
    run = rep["runs"][0]
    f = run["fault"]
    assert f["node"] == "disagg-prefill-0" and f["restart_error"] is None
    assert f["kill_s"] >= 1.0 and f["ready_s"] > f["kill_s"]
    reqs = run["requests"]
    failed = [r for r in reqs if r["status"] == "error"]
    ok = [r for r in reqs if r["status"] == "ok"]
    assert failed, "the kill took no request down: it did not land mid-replay"
    assert len(failed) == f["num_failed"] and len(failed) + len(ok) == len(reqs) == 40
    for r in failed:  # each failure says what happened, and happened while the node was down
        assert "prefill node" in r["error"], r["error"]
        assert r["sent_s"] <= f["ready_s"] + 0.5, r
    assert f["failed_all_have_errors"] and f["failed_all_in_outage"]
    for r in ok:
        assert r["num_tokens"] == r["max_tokens"]
    assert any(r["sent_s"] > f["ready_s"] for r in ok), "no request was served after the restart"
    assert f["time_to_first_success_s"] is not None and f["time_to_ready_s"] > 0
    assert f["pools_back_to_start"] and run["pools_back_to_start"], run["pools_after"]
    assert all(p["free"] == p["total"] for p in run["pools_after"].values())
    md = (tmp_path / "report.md").read_text()
    assert "**fault on disagg**" in md
