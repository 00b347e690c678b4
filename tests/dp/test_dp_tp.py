"""tp x dp (``parallel: {dp: 2, tp: 2, ep: true}``, pdkv/dp/lane.py): two DP ranks, each a TP2
engine (four real processes over gloo); attention TP within each DP rank, the routed experts 4 + 4
across the DP ranks and each rank's sliced across its TP ranks, the all-to-all run per lane (TP
rank t of both DP ranks). It gives exactly the greedy tokens of one TP1 engine for Qwen3-MoE and
DeepSeek-V3 (MLA, shared experts: counted once by the TP all-reduce) with one DP rank idle for
several steps (its leader and its lane follower both run dummy forwards: a lane that missed one
would be out of step and fail the group); an abort on one rank mid-run; a lane follower killed
fails the group's requests with an error naming it, in bounded time; layouts that do not divide
are refused by name before any process starts.

4 processes on a shared 2-core box: the groups are built once per module, tiny models, few tokens."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from pdkv.config import ConfigError, KVCacheConfig, ModelConfig, ParallelConfig, SchedulerConfig
from pdkv.dp.group import DPGroup, DPRankError, check_dp_model
from pdkv.engine import SamplingParams
from pdkv.models.loader import read_json

from _dp_groups import check_abort_mid_run, check_uneven_run_finishes, reference, start_groups

KV = KVCacheConfig(page_size=4, num_pages=64)
SCHED = SchedulerConfig(max_num_batched_tokens=24, chunk_size=8, max_num_seqs=4)
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
SHORT = [[7, 8, 9, 10, 11], [5, 6, 7]]
LONG = list(range(3, 23))  # 20 tokens: 3 chunks
PAR = dict(dp=2, tp=2, ep=True, timeout_s=30.0, startup_timeout_s=300.0)


@pytest.fixture(scope="module")
def groups(moe_models):
    yield from start_groups(moe_models, KV, SCHED, ParallelConfig(**PAR))


def _reference(folder, prompts):
    return reference(folder, prompts, KV, SCHED, GREEDY)


def _gone(pid: int) -> bool:
    """Exited (no process, or a zombie nobody reaped yet)."""
    try:
        return Path(f"/proc/{pid}/status").read_text().split("State:")[1].split()[0] == "Z"
    except (FileNotFoundError, IndexError):
        return True


@pytest.mark.slow  # two tp x dp groups: 8 processes start on a loaded box
@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3"])
def test_dp2_tp2_gives_tp1_greedy_tokens_with_an_idle_rank(family, groups, moe_models):
    g = groups[family]
    assert g.experts == [tuple(range(0, 4)), tuple(range(4, 8))]  # whole on the DP rank, sliced in it
    assert len(g.lane_pids) == 2 and not any(_gone(p) for p in g.lane_pids)  # one follower per DP rank
    ref = _reference(moe_models[family], SHORT + [LONG])
    dummies = list(g.dummy_steps)
    for i, p in enumerate(SHORT):  # rank 0 alone has work: rank 1 and its lane run dummy forwards
        assert g.add_request(f"{family}-s{i}", p, GREEDY, rank=0) == 0
    for _ in range(3):
        g.step()
    assert g.dummy_steps[1] - dummies[1] == 3 and g.dummy_steps[0] == dummies[0]
    g.add_request(f"{family}-long", LONG, GREEDY, rank=1)  # a long prefill on rank 1 while rank 0 decodes
    check_uneven_run_finishes(g, family, len(SHORT), ref, KV.num_pages, 3)


@pytest.mark.slow
def test_abort_on_one_rank_mid_run(groups, moe_models):
    family = "qwen3_moe"  # rank 1 and its lane run dummies after the abort
    check_abort_mid_run(groups[family], _reference(moe_models[family], [SHORT[0]])[0], SHORT[0], LONG, GREEDY, 1)


@pytest.mark.slow  # a group of its own (it is broken after)
def test_a_killed_lane_fails_the_group_cleanly_and_in_bounded_time(moe_models):
    g = DPGroup(ModelConfig(path=str(moe_models["qwen3_moe"])), KV, SCHED,
                ParallelConfig(**{**PAR, "timeout_s": 6.0}))
    g.step_grace_s = 4.0
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    try:
        g.add_request("a", [5, 6, 7, 8], params, rank=0)
        g.add_request("b", [9, 10, 11], params, rank=1)
        for _ in range(2):
            assert all(not o.finished for o in g.step())
        victim = g.lane_pids[1]  # TP rank 1 of DP rank 1
        os.kill(victim, signal.SIGKILL)
        t0 = time.monotonic()
        outs = g.step()
        assert time.monotonic() - t0 < g.timeout_s + g.step_grace_s + 5  # bounded
        final = {o.request_id: o for o in outs if o.finished}
        assert set(final) == {"a", "b"} and {o.finish_reason for o in final.values()} == {"error"}
        assert not g.healthy and not g.has_unfinished()
        with pytest.raises(DPRankError, match=rf"data-parallel rank 1.*tensor-parallel rank 1 \(pid {victim}\)"):
            g.step()
        with pytest.raises(DPRankError):
            g.add_request("c", [1, 2, 3], params)
    finally:
        g.close()
    assert all(p.poll() is not None for p in g.procs)
    deadline = time.monotonic() + 10
    while not all(_gone(p) for p in g.lane_pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert all(_gone(p) for p in g.lane_pids)  # no follower left behind


def test_tp_dp_layouts_that_do_not_divide_are_named(moe_models):
    from pdkv.config import Config
    from pdkv.config.validate import validate

    qwen = read_json(moe_models["qwen3_moe"] / "config.json")
    for parallel, message in [
        (ParallelConfig(dp=2, tp=3, ep=True), r"parallel.tp=3 must divide num_attention_heads=4"),
        (ParallelConfig(dp=3, tp=2, ep=True), r"parallel.dp=3 must divide the 8 routed experts"),
        (ParallelConfig(dp=2, tp=2, ep=True, expert_parallel=True), r"parallel.expert_parallel with parallel.dp=2"),
    ]:
        with pytest.raises(ConfigError, match=message):
            check_dp_model(parallel, qwen, "config.json")
    narrow = {**qwen, "moe_intermediate_size": 30}  # an expert's width tp=4 cannot slice
    with pytest.raises(ConfigError, match=r"parallel.tp=4 must divide moe_intermediate_size=30"):
        check_dp_model(ParallelConfig(dp=2, tp=4, ep=True), narrow, "config.json")
    check_dp_model(ParallelConfig(dp=2, tp=2, ep=True), read_json(moe_models["deepseek_v3"] / "config.json"),
                   "config.json")  # 8 experts / 2, 4 heads / 2, shared width 64 / 2: fine
    for role, parallel, field in [
        ("decode", ParallelConfig(dp=2, tp=2, ep=True), "parallel.tp"),  # disaggregated tp x dp: refused
        ("colocated", ParallelConfig(dp=2, tp=2, ep=True, expert_parallel=True), "parallel.expert_parallel"),
    ]:
        with pytest.raises(ConfigError, match=field):
            validate(Config(role=role, parallel=parallel), {}, check_paths=False)
    validate(Config(parallel=ParallelConfig(dp=2, tp=2, ep=True)), {}, check_paths=False)
    t0 = time.monotonic()  # refused before any process starts
    with pytest.raises(ConfigError, match="parallel.tp=3"):
        DPGroup(ModelConfig(path=str(moe_models["deepseek_v3"])), KV, SCHED, ParallelConfig(dp=2, tp=3, ep=True))
    with pytest.raises(ValueError, match="disaggregated tp x dp group is not implemented"):
        DPGroup(ModelConfig(path=str(moe_models["qwen3_moe"])), KV, SCHED, ParallelConfig(dp=2, tp=2, ep=True),
                shared_kv=True, role="decode")
    assert time.monotonic() - t0 < 5
