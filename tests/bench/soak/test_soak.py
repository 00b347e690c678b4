"""``python -m pdkv.bench soak`` for a fraction of a minute: a real disaggregated pair (two
``pdkv serve`` processes), a mixed open-loop load with planned client aborts, one SIGKILL and
restart of the prefill node. The report must hold every field the 30-minute run is read from,
the failures must all be the restart's, and both page pools must be back to their start."""
from __future__ import annotations

import contextlib
import io
import json
import os

import pytest

from pdkv.bench.soak.cli import main


@pytest.mark.slow  # 36 s of load and a restart: about a minute
def test_short_soak_with_one_prefill_restart(tiny_model_dir, tmp_path):
    cpus = ",".join(map(str, sorted(os.sched_getaffinity(0))[:2]))
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        # 36 s of load, one restart at 16 s: a restart takes 6-16 s here (a fresh process imports
        # torch and loads the model), so requests are still sent after the decode node redialled
        rc = main(["--minutes", "0.6", "--restart-every", "16", "--sample-s", "0.5", "--rate", "2",
                   "--abort-p", "0.3", "--model", str(tiny_model_dir), "--cpus", cpus, "--out", str(tmp_path),
                   "--no-progress"])
    rep = json.loads((tmp_path / "report.json").read_text())
    assert rc == 0, (err.getvalue(), rep["verdict"], rep["failures"])
    for key in ("command", "minutes", "config", "nodes", "restarts", "samples", "summary", "outcomes",
                "failures", "pools_after", "verdict", "plot"):
        assert key in rep, key
    assert (tmp_path / rep["plot"]).stat().st_size > 1000 and (tmp_path / "report.md").is_file()

    # exactly one restart, of the prefill node, which came back and was redialled
    assert [r["node"] for r in rep["restarts"]] == ["disagg-prefill-0"]
    r = rep["restarts"][0]
    assert r["kill_s"] >= 16.0 and r["ready_s"] > r["kill_s"] and "error" not in r
    assert {n["name"]: n["starts"] for n in rep["nodes"]} == {"disagg-prefill-0": 2, "disagg-decode-0": 1}

    # the load was mixed and really ran: streamed and not, short and long, planned aborts
    outs = rep["outcomes"]
    assert {o["stream"] for o in outs} == {True, False} and {o["kind"] for o in outs} == {"short", "long"}
    assert any(o["status"] == "aborted" for o in outs) and any(o["status"] == "ok" for o in outs)
    assert any(o["status"] == "ok" and o["sent_s"] > r["ready_s"] for o in outs), "nothing served after the restart"
    f = rep["failures"]
    assert f["num_ok"] + f["num_aborted"] + f["num_failed"] == f["num_requests"] == len(outs)
    assert f["num_failed_unexcused"] == 0 and f["ok"]
    for x in f["failed"]:
        assert x["hit_by_restart"] and x["error"], x

    # samples of both nodes from /proc and /health, the prefill node down during its restart
    s = rep["samples"]
    for node in ("disagg-prefill-0", "disagg-decode-0"):
        up = [x for x in s if x["node"] == node and x["up"]]
        assert len(up) >= 10
        assert all(x["rss_bytes"] > 10 << 20 and x["fds"] > 3 and x["threads"] >= 1 for x in up)
        assert all(x["pages_total"] > 0 and x["pages_used"] == x["pages_total"] - x["pages_free"] for x in up)
        assert all(x["pages_held"] is not None for x in up)
    assert any(not x["up"] for x in s if x["node"] == "disagg-prefill-0" and r["kill_s"] < x["t_s"] < r["ready_s"])
    assert {x["start"] for x in s if x["node"] == "disagg-prefill-0" and x["up"]} == {1, 2}

    # pools back to their start; the flatness verdict was computed from judged windows
    assert rep["verdict"]["pools_ok"] and all(p["free"] == p["total"] for p in rep["pools_after"].values())
    fl = rep["verdict"]["flatness"]
    assert sum(n["judged_windows"] for n in fl["nodes"].values()) >= 3
    assert rep["verdict"]["flat"] and rep["verdict"]["pass"]
