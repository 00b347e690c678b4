"""bench fleet-sim's discrete-event model, on small synthetic traces (seconds)."""

import json

import pytest

from pdkv.bench import fleet_sim as fs
from pdkv.planner.capacity import capacities_from_dict
from pdkv.planner.decide import Planner, Policy

CAPS = capacities_from_dict({"prefill": {"points": [{"tokens_per_s": 1000, "ttft_ms": 500},
                                                    {"tokens_per_s": 2000, "ttft_ms": 2000}]},
                             "decode": {"points": [{"streams": 1, "itl_ms": 10}, {"streams": 20, "itl_ms": 40}],
                                        "max_streams": 32}})


def trace(n, gap_s, prompt, out):
    return [(i * gap_s, prompt, out) for i in range(n)]


def run(tr, fleet=None, planner=False, startup_s=5.0, warm=False):
    pol = Policy(ttft_ms=2000, itl_ms=40, min_nodes={"prefill": 1, "decode": 1},
                 max_nodes={"prefill": 64, "decode": 64}, interval_s=2.0, scale_down_cooldown_s=20,
                 scale_down_stable_s=10)
    sim = fs.FleetSim(CAPS, fleet, pol if planner else None, startup_s, 0.0, 2.0)
    sim.warm = warm  # cold: the managed fleet starts at 1P:1D and has to grow
    rep = sim.run(tr, tail_s=120)
    return sim, rep, fs.summarize(rep["reqs"], 2000, 40, sim.rate)


def test_light_load_meets_the_slo_on_one_pair_with_exact_times():
    sim, rep, s = run(trace(10, 10.0, 500, 11), {"prefill": 1, "decode": 1})
    assert s["slo_attainment"] == 1.0 and s["unfinished"] == 0
    r = rep["reqs"][0]
    assert r.first - r.arrival == pytest.approx(0.25)  # 500 tokens at 2000 tokens/s, nothing queued
    assert r.itl == pytest.approx(0.010)  # alone on its decode node: the curve's first point
    assert rep["node_hours"] == pytest.approx(2 * (90 + 120) / 3600)  # two nodes over the trace + the tail


def test_overload_the_planner_grows_the_right_role_and_meets_what_fixed_fleets_miss():
    long_prompts = trace(600, 0.1, 1500, 2)  # 15k prompt tokens/s: ~9 prefill nodes, few streams
    _, _, fixed = run(long_prompts, {"prefill": 1, "decode": 3})
    sim, _, managed = run(long_prompts, planner=True)
    assert isinstance(sim.planner, Planner)  # the planner's own decision code in the loop
    assert fixed["slo_attainment"] < 0.1 and managed["slo_attainment"] > 0.8
    peak_p = max(t[1] for t in sim.timeline)
    peak_d = max(t[2] for t in sim.timeline)
    assert peak_p >= 8 and peak_d <= 2
    chats = trace(600, 0.1, 50, 200)  # 200-token answers: ~200 streams at once, prefill is trivial
    sim, _, managed = run(chats, planner=True)
    assert max(t[1] for t in sim.timeline) <= 2 and max(t[2] for t in sim.timeline) >= 8
    assert sim.timeline[-1][1:] == (1, 1)  # drained back down after the load ended


def test_scaling_the_trace_keeps_its_shape(tmp_path):
    tr = trace(1000, 1.0, 100, 10)
    assert len(fs.scale_trace(tr, 0.5, 1.0, 0)) == pytest.approx(500, abs=60)
    assert len(fs.scale_trace(tr, 3.0, 1.0, 0)) == 3000
    p = tmp_path / "t.jsonl"
    p.write_text("".join(json.dumps({"timestamp": t * 1000, "input_length": i, "output_length": o}) + "\n"
                         for t, i, o in [(5, 10, 2), (0, 20, 3)]))
    assert fs.load_trace(str(p), tmp_path) == [(0.0, 20, 3), (5.0, 10, 2)]
    c = tmp_path / "t.csv"
    c.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\r\n2023-11-16 18:15:46.5000000,374,44\r\n"
                 "2023-11-16 18:15:47.0000000,10,5")
    assert fs.load_trace(str(c), tmp_path) == [(0.0, 374, 44), (0.5, 10, 5)]


def test_warm_start_sizes_the_managed_fleet_for_the_first_minute():
    sim, _, managed = run(trace(600, 0.1, 1500, 2), planner=True, warm=True)
    assert sim.initial["prefill"] >= 8 and sim.initial["decode"] == 1  # 15k tokens/s at 80% of 2000
    assert managed["slo_attainment"] > 0.95


def test_an_slo_no_node_meets_is_one_line(tmp_path, capsys):
    caps = tmp_path / "c.json"
    caps.write_text(json.dumps(CAPS.to_json()))
    tr = tmp_path / "t.jsonl"
    tr.write_text(json.dumps({"timestamp": 0, "input_length": 10, "output_length": 2}) + "\n")
    assert fs.main(["--trace", str(tr), "--capacities", str(caps), "--ttft-ms", "100", "--itl-ms", "40"]) == 2
    assert "no number of prefill nodes can meet a TTFT SLO of 100 ms" in capsys.readouterr().err
    assert fs.main(["--trace", str(tr), "--capacities", str(tmp_path / "none.json"), "--ttft-ms", "1000",
                    "--itl-ms", "40"]) == 2
    assert "cannot read the capacities file" in capsys.readouterr().err


def test_main_writes_the_table_json_and_plot(tmp_path):
    caps = tmp_path / "c.json"
    caps.write_text(json.dumps(CAPS.to_json()))
    tr = tmp_path / "t.jsonl"
    tr.write_text("".join(json.dumps({"timestamp": i * 500, "input_length": 800, "output_length": 20}) + "\n"
                          for i in range(200)))
    out, png = tmp_path / "r.json", tmp_path / "r.png"
    assert fs.main(["--trace", str(tr), "--capacities", str(caps), "--ttft-ms", "2000", "--itl-ms", "40",
                    "--loads", "1,4", "--tail-s", "60", "--out", str(out), "--plot", str(png)]) == 0
    d = json.loads(out.read_text())
    assert [(r["load"], r["fleet"]) for r in d["results"]] == [(1, "1p1d"), (1, "1p3d"), (1, "planner"),
                                                               (4, "1p1d"), (4, "1p3d"), (4, "planner")]
    four = {r["fleet"]: r for r in d["results"] if r["load"] == 4}
    assert four["planner"]["slo_attainment"] > four["1p1d"]["slo_attainment"]
    assert png.stat().st_size > 10_000
