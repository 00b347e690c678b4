"""A ~30-request replay of a real Mooncake slice on the tiny model, at two rates, against
colocated, chunked and disaggregated serving, each launched by the harness as `pdkv serve`
processes pinned to the same CPU budget: the report, its schema, the accounting of every
request, identical request streams, the client against the servers' own histograms."""
from __future__ import annotations

import json
import os

import jsonschema
import pytest

from _abrun import MOONCAKE, budget, run_ab

NUM = 30
# the module fixture replays six runs of `pdkv serve` processes: over a minute on 2 cores
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def report(tiny_model_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("ab")
    rc, err = run_ab(["--trace", str(MOONCAKE), "--window", "0:100", "--first", str(NUM), "--length-scale", "0.02",
                      "--output-scale", "0.03", "--rates", "4,8", "--model", str(tiny_model_dir), "--cpus", budget(),
                      "--out", str(out)])
    assert rc == 0, err
    return out, json.loads((out / "report.json").read_text())


def test_report_validates_against_its_schema(report):
    from pdkv.bench.ab.schema import validate

    out, rep = report
    validate(rep)
    assert [a["name"] for a in rep["archs"]] == ["colocated", "chunked", "disagg"]
    broken = json.loads(json.dumps(rep))
    broken["runs"][0]["requests"][0]["status"] = "error"  # a failure without its error message
    broken["runs"][0]["requests"][0]["error"] = None
    with pytest.raises(jsonschema.ValidationError):
        validate(broken)


def test_every_request_accounted_for_with_exact_token_counts(report):
    _, rep = report
    assert [(r["arch"], r["rate"]) for r in rep["runs"]] == [(a, x) for a in ("colocated", "chunked", "disagg")
                                                             for x in (4.0, 8.0)]
    for run in rep["runs"]:
        reqs = run["requests"]
        assert len(reqs) == NUM and len({r["id"] for r in reqs}) == NUM
        for r in reqs:
            assert r["status"] == "ok", r["error"]
            assert r["num_tokens"] == r["max_tokens"] == r["usage_tokens"] == sum(r["chunk_tokens"])
        s = run["summary"]["all"]
        assert s["num_ok"] == NUM and s["num_failed"] == 0
        assert s["num_requests"] == sum(run["summary"][c]["num_requests"] for c in ("short", "long")
                                        if run["summary"][c])
        assert run["pools_back_to_start"], run["pools_after"]
        assert run["server"]["generation_tokens"] == sum(r["max_tokens"] for r in reqs)


def test_architectures_received_byte_identical_request_sequences(report):
    _, rep = report
    for rate in (4.0, 8.0):
        seqs = [[(r["body_sha256"], r["scheduled_s"], r["prompt_tokens"], r["max_tokens"]) for r in run["requests"]]
                for run in rep["runs"] if run["rate"] == rate]
        assert len(seqs) == 3 and seqs[0] == seqs[1] == seqs[2]
        assert len({s[0] for s in seqs[0]}) == NUM  # and they are not all the same request
    offered = {r["rate"]: r["offered_rate_rps"] for r in rep["runs"]}
    assert offered[4.0] == pytest.approx(4.0) and offered[8.0] == pytest.approx(8.0)
    assert rep["identical_requests"] == {"4.0": True, "8.0": True}


def test_each_architecture_ran_on_the_same_pinned_cpus(report):
    _, rep = report
    cpus = [int(c) for c in budget().split(",")]
    nodes = {n["name"]: n for a in rep["archs"] for n in a["nodes"]}
    for name in ("colocated-colocated-0", "chunked-colocated-0"):
        assert nodes[name]["cpus_actual"] == cpus
    pre, dec = nodes["disagg-prefill-0"]["cpus_actual"], nodes["disagg-decode-0"]["cpus_actual"]
    assert sorted(set(pre) | set(dec)) == cpus
    if len(cpus) == 2:
        assert pre == cpus[:1] and dec == cpus[1:]
    disagg = next(a for a in rep["archs"] if a["name"] == "disagg")
    assert disagg["duplicated_weight_bytes"] == rep["model"]["weight_bytes"] > 0


def test_disaggregated_run_moved_kv_and_colocated_did_not(report):
    _, rep = report
    by = {r["arch"]: r for r in rep["runs"]}
    d = by["disagg"]["server"]
    assert d["kv_bytes_received"] == d["kv_bytes_sent"] > 0
    assert d["kv_transfer_time"]["count"] == NUM
    assert by["colocated"]["server"]["kv_bytes_received"] == 0


def test_client_latencies_agree_with_the_servers_histograms(report):
    """Stated tolerance (serverside.AGREE_*): TTFT mean within 150 ms + 25%, ITL mean within 10 ms + 25%,
    and exactly as many first tokens and inter-token gaps as the servers observed."""
    _, rep = report
    for run in rep["runs"]:
        a = run["agreement"]
        where = (run["arch"], run["rate"], a)
        assert a["ttft_count_client"] == a["ttft_count_server"] == NUM, where
        assert a["itl_count_client"] == a["itl_count_server"] > 0, where
        assert a["ttft_ok"] and a["itl_ok"], where
        # the client cannot see a first token before the server made it
        assert a["ttft_mean_client_s"] >= a["ttft_mean_server_s"] - 0.002, where


def test_markdown_plots_and_verdict_are_written(report):
    out, rep = report
    md = (out / "report.md").read_text()
    assert "| colocated | all |" in md and "| disagg | all |" in md and "## Verdict" in md
    for png in ("ttft_cdf.png", "itl_cdf.png", "itl_timeline.png", "goodput_vs_rate.png"):
        data = (out / png).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000, png
    v = rep["verdict"]
    assert v["overall"] in ("disaggregate", "chunked", "colocated")
    assert [p["rate"] for p in v["per_rate"]] == [4.0, 8.0]
    assert "p99 ITL" in v["per_rate"][0]["text"] and "goodput" in v["per_rate"][0]["text"]
    assert "## Rate sweep" in md
    co = rep["runs"][0]["client_overhead"]
    assert co["cpu_per_token_us"] > 0 and co["send_lag_s"]["n"] == NUM
    assert os.path.isdir(out / "logs" / "disagg")
    # --render recomputes the verdict from the JSON alone (no replay) and writes the same summary
    (out / "report.md").unlink()
    rc, err = run_ab(["--render", str(out), "--no-plots"])
    assert rc == 0, err
    assert (out / "report.md").read_text() == md
