"""The planner's decision code (pdkv/planner/decide.py) and capacity curves, without processes."""

import pytest

from pdkv.config import ConfigError
from pdkv.planner.capacity import InfeasibleSLO, capacities_from_dict
from pdkv.planner.config import planner_config_from_dict
from pdkv.planner.decide import Observation, Planner, Policy

CAPS = capacities_from_dict({
    "prefill": {"points": [{"tokens_per_s": 500, "ttft_ms": 200}, {"tokens_per_s": 1000, "ttft_ms": 600},
                           {"tokens_per_s": 1200, "ttft_ms": 2000}]},
    "decode": {"points": [{"streams": 1, "itl_ms": 20}, {"streams": 8, "itl_ms": 40},
                          {"streams": 16, "itl_ms": 80}], "max_streams": 64}})


def policy(**kw):
    base = dict(ttft_ms=600, itl_ms=40, min_nodes={"prefill": 1, "decode": 1},
                max_nodes={"prefill": 8, "decode": 8}, interval_s=1.0, scale_down_cooldown_s=10,
                scale_down_stable_s=5)
    base.update(kw)
    return Policy(**base)


def obs(t, tps=0.0, queued=0, streams=0.0, ttft=None, itl=None):
    return Observation(t=t, prompt_tokens_per_s=tps, queued_prompt_tokens=queued, decode_streams=streams,
                       ttft_ms=ttft, itl_ms=itl)


def test_capacity_at_slo_interpolates_and_refuses_the_impossible():
    assert CAPS.prefill_tokens_per_s(600) == 1000
    assert CAPS.prefill_tokens_per_s(400) == pytest.approx(750)  # halfway between 200 and 600 ms
    assert CAPS.prefill_tokens_per_s(10_000) == 1200
    assert CAPS.decode_streams(60) == pytest.approx(12)
    with pytest.raises(InfeasibleSLO, match="TTFT SLO of 100 ms.*200 ms"):
        CAPS.prefill_tokens_per_s(100)
    with pytest.raises(InfeasibleSLO, match="ITL SLO of 5 ms"):
        CAPS.decode_streams(5)


def test_step_of_long_prompts_adds_prefill_not_decode():
    p = Planner(policy(), CAPS)
    assert p.decide(obs(0, tps=100, streams=1)).desired == {"prefill": 1, "decode": 1}
    # 4 long prompts a second (2000 tokens each, 1 output token): prefill bound, few streams
    plan = p.decide(obs(1, tps=8000, queued=6000, streams=2))
    assert plan.desired["decode"] == 1
    assert plan.desired["prefill"] == 8  # (8000 + 6000/2) / (1000 * 0.8) = 13.75 -> capped at max 8
    assert any("SLO not met" in r for r in plan.reasons["prefill"])
    plan2 = Planner(policy(), CAPS).decide(obs(1, tps=2000, streams=2))
    assert plan2.desired == {"prefill": 3, "decode": 1}  # 2000 / 800 = 2.5
    assert plan2.changed and "needs 3 node(s)" in plan2.reasons["prefill"][0]


def test_many_short_conversations_add_decode_not_prefill():
    p = Planner(policy(), CAPS)
    plan = p.decide(obs(0, tps=300, streams=30))  # 30 streams / (8 * 0.8) = 4.7
    assert plan.desired == {"prefill": 1, "decode": 5}


def test_falling_load_scales_down_only_after_stability_and_cool_down_one_at_a_time():
    p = Planner(policy(smoothing=1.0), CAPS)
    assert p.decide(obs(0, streams=30)).desired["decode"] == 5
    downs = []
    for t in range(1, 60):
        plan = p.decide(obs(t, streams=2))
        if plan.changed:
            downs.append((t, plan.desired["decode"]))
    # first step down: 10 s cool-down since the scale-up at t=0 and 5 s of stability; then one per 10 s
    assert downs[0] == (10, 4)
    assert [n for _, n in downs] == [4, 3, 2, 1]
    assert all(b - a >= 10 for (a, _), (b, _) in zip(downs, downs[1:]))
    assert p.decide(obs(61, streams=0)).desired["decode"] == 1  # never below min_nodes


def test_no_flapping_on_load_oscillating_around_a_threshold():
    p = Planner(policy(), CAPS)
    changes = []
    for t in range(300):
        # 6.4 streams is exactly 1 node at 80%: swing across it every other interval
        plan = p.decide(obs(t, streams=7 if t % 2 else 6, tps=700 if t % 3 else 900))
        if plan.changed:
            changes.append((t, plan.desired))
    assert len(changes) <= 2, changes  # each role may grow once, and none shrinks back and forth


def test_measured_slo_miss_adds_a_node_and_blocks_shrinking():
    p = Planner(policy(smoothing=1.0), CAPS, initial={"prefill": 2, "decode": 2})
    plan = p.decide(obs(0, tps=100, streams=2, ttft=900))
    assert plan.desired["prefill"] == 3 and "measured TTFT 900 ms > SLO" in plan.reasons["prefill"][0]
    for t in range(1, 40):
        plan = p.decide(obs(t, tps=100, streams=2, ttft=50, itl=200))
    assert plan.desired["decode"] == 8  # ITL over SLO every interval: one more each time, up to max, no shrink
    assert plan.desired["prefill"] < 3  # TTFT fine again: shrinks after cool-down


def test_config_names_infeasible_slo_and_bad_fields():
    base = {"slo": {"ttft_ms": 600, "itl_ms": 40}, "capacities": CAPS.to_json(), "nodes": {"prefill": "1..4"}}
    cfg = planner_config_from_dict(base, "p.yaml")
    assert cfg.policy.max_nodes["prefill"] == 4 and cfg.policy.max_nodes["decode"] == 8
    with pytest.raises(ConfigError, match="p.yaml: no number of decode nodes can meet a ITL SLO of 10 ms"):
        planner_config_from_dict({**base, "slo": {"ttft_ms": 600, "itl_ms": 10}}, "p.yaml")
    with pytest.raises(ConfigError, match="nodes.decode: min 5 > max 2"):
        planner_config_from_dict({**base, "nodes": {"decode": "5..2"}}, "p.yaml")
    with pytest.raises(ConfigError, match="unknown field 'policy.bogus'"):
        planner_config_from_dict({**base, "policy": {"bogus": 1}}, "p.yaml")
    with pytest.raises(ConfigError, match="scale_down_utilization < target_utilization"):
        planner_config_from_dict({**base, "policy": {"scale_down_utilization": 0.9}}, "p.yaml")
    with pytest.raises(ConfigError, match=r"prefill.points\[0\].ttft_ms must be a positive number"):
        planner_config_from_dict({**base, "capacities": {"prefill": {"points": [{"tokens_per_s": 1}]},
                                                         "decode": {"points": [{"streams": 1, "itl_ms": 1}]}}})


def test_noisy_curve_is_made_monotone():
    caps = capacities_from_dict({
        "prefill": {"points": [{"tokens_per_s": 196, "ttft_ms": 5216}, {"tokens_per_s": 128, "ttft_ms": 15424},
                               {"tokens_per_s": 516, "ttft_ms": 25298}]},
        "decode": {"points": [{"streams": 1, "itl_ms": 12}]}})
    assert caps.prefill.latencies_ms == (5216, 5216, 25298)
    assert caps.prefill_tokens_per_s(6000) == pytest.approx(196 + (6000 - 5216) / (25298 - 5216) * 320)


def test_shipped_planner_config_loads():
    from pathlib import Path

    from pdkv.planner.config import load_planner_config

    cfg = load_planner_config(Path(__file__).resolve().parents[2] / "configs" / "planner.yaml")
    assert cfg.actuator == "local" and cfg.policy.max_nodes == {"prefill": 2, "decode": 2}
    assert cfg.caps.prefill_tokens_per_s(cfg.policy.ttft_ms) > 0


def test_observer_reads_counters_and_histogram_deltas():
    from pdkv.planner.observe import NodeSample, Observer, parse_metrics, quantile

    def text(prompt, ttft_counts):
        les = ["0.1", "1.0", "+Inf"]
        rows = [f'pdkv_time_to_first_token_seconds_bucket{{le="{le}",model_name="m"}} {c}'
                for le, c in zip(les, ttft_counts)]
        return ("# TYPE pdkv_prompt_tokens_total counter\n"
                f'pdkv_prompt_tokens_total{{model_name="m"}} {prompt}\n'
                "# TYPE pdkv_time_to_first_token_seconds histogram\n" + "\n".join(rows) + "\n")

    assert quantile({0.1: 5, 1.0: 10, float("inf"): 10}, 0.5) == pytest.approx(0.1)
    assert quantile({0.1: 0, 1.0: 10, float("inf"): 10}, 0.9) == pytest.approx(0.91)
    assert quantile({}, 0.9) is None
    o = Observer(0.9)
    load = {"role": "decode", "num_running": 3, "num_waiting": 4, "num_remote": 2, "queued_prompt_tokens": 100}
    first = o.observe(10.0, [NodeSample("http://d", "decode", load, parse_metrics(text(1000, [0, 0, 0])))])
    assert first.prompt_tokens_per_s == 0 and first.ttft_ms is None  # no baseline yet
    assert first.decode_streams == 5 and first.queued_prompt_tokens == 100  # remote waits are not streams
    pre = NodeSample("http://p", "prefill", {"role": "prefill", "queued_prompt_tokens": 900},
                     parse_metrics(text(99999, [0, 0, 0])))
    nxt = o.observe(12.0, [NodeSample("http://d", "decode", load, parse_metrics(text(3000, [0, 10, 10]))), pre])
    assert nxt.prompt_tokens_per_s == pytest.approx(1000)  # 2000 tokens in 2 s; the prefill node's not counted
    assert nxt.queued_prompt_tokens == 1000 and nxt.ttft_ms == pytest.approx(910)
    restarted = o.observe(14.0, [NodeSample("http://d", "decode", load, parse_metrics(text(10, [0, 1, 1])))])
    assert restarted.prompt_tokens_per_s == 0 and restarted.ttft_ms is None  # counters went down: new baseline


def test_big_fleet_shrinks_by_a_quarter_never_below_the_need():
    p = Planner(policy(smoothing=1.0, max_nodes={"prefill": 8, "decode": 100}), CAPS, initial={"decode": 100})
    plan = None
    for t in range(0, 11):
        plan = p.decide(obs(t, streams=200))  # 200 / (8 * 0.6) -> 42 nodes at the lower band
    assert plan.desired["decode"] == 75  # 100 - 25 at t=10 (5 s stable, 10 s since... no change before)
    for t in range(11, 60):
        plan = p.decide(obs(t, streams=200))
    assert plan.desired["decode"] == 42  # 75 -> 57 -> 43 -> 42: floors at the need


def test_a_long_prompt_over_the_ttft_slo_with_no_queue_adds_no_node():
    p = Planner(policy(), CAPS, initial={"prefill": 2})
    plan = p.decide(Observation(t=0, prompt_tokens_per_s=100, queued_prompt_tokens=900, decode_streams=1,
                                queued_prompts=1, ttft_ms=5000))
    assert plan.desired["prefill"] == 2 and "long prompts, not too few nodes" in plan.reasons["prefill"][0]
    plan = p.decide(Observation(t=1, prompt_tokens_per_s=100, queued_prompt_tokens=900, decode_streams=1,
                                queued_prompts=3, ttft_ms=5000))
    assert plan.desired["prefill"] == 3  # now prompts wait behind others: one more node


def test_pdkv_planner_refuses_an_slo_no_count_meets(tmp_path):
    import os
    import subprocess
    import sys
    from pathlib import Path

    import yaml

    root = Path(__file__).resolve().parents[2]
    f = tmp_path / "planner.yaml"
    f.write_text(yaml.safe_dump({"slo": {"ttft_ms": 50, "itl_ms": 40}, "capacities": CAPS.to_json()}))
    r = subprocess.run([sys.executable, "-m", "pdkv", "planner", "-c", str(f)], capture_output=True, text=True,
                       timeout=60, env={**os.environ, "PYTHONPATH": str(root)})
    assert r.returncode == 2
    assert "no number of prefill nodes can meet a TTFT SLO of 50 ms" in r.stderr and str(f) in r.stderr
