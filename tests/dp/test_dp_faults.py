"""Failures of a data-parallel expert-parallel group (pdkv/dp/group.py): a rank killed mid-run
(SIGKILL) or stuck (SIGSTOP) ends the group's requests with finish_reason "error" within the
documented bound (parallel.timeout_s + the front's grace), names the rank, leaves the endpoint
unhealthy and the live ranks' pages free; bad parallel settings are refused by field name before
any process starts."""

from __future__ import annotations

import os
import signal
import time

import pytest

from pdkv.config import ConfigError, KVCacheConfig, ModelConfig, ParallelConfig, SchedulerConfig
from pdkv.dp.group import DPGroup, DPRankError, check_dp_model, rank_cpu_sets
from pdkv.engine import SamplingParams
from pdkv.models.loader import read_json

KV = KVCacheConfig(page_size=4, num_pages=64)
SCHED = SchedulerConfig(max_num_batched_tokens=24, chunk_size=8, max_num_seqs=4)
GREEDY = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
_ALLOWED = sorted(os.sched_getaffinity(0))
CPUS = f"{_ALLOWED[0]},{_ALLOWED[1]}" if len(_ALLOWED) >= 2 else ""


@pytest.mark.slow  # a group of its own per case (it is broken after): ~30 s to start on a loaded box
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGSTOP])
def test_a_rank_that_dies_or_hangs_fails_the_group_cleanly_and_in_bounded_time(sig, moe_models):
    g = DPGroup(ModelConfig(path=str(moe_models["qwen3_moe"])), KV, SCHED,
                ParallelConfig(dp=2, ep=True, timeout_s=4.0, startup_timeout_s=300.0, cpus=CPUS))
    g.step_grace_s = 4.0
    try:
        if CPUS:  # parallel.cpus: each rank pinned to its share
            assert g.rank_cpus == [tuple(int(c) for c in s.split(",")) for s in rank_cpu_sets(CPUS, 2)]
        g.add_request("a", [5, 6, 7, 8], GREEDY, rank=0)
        g.add_request("b", [9, 10, 11], GREEDY, rank=1)
        for _ in range(3):
            assert all(not o.finished for o in g.step())
        os.kill(g.pids[1], sig)
        t0 = time.monotonic()
        outs = g.step()
        waited = time.monotonic() - t0
        assert waited < g.timeout_s + g.step_grace_s + 5  # bounded: parallel.timeout_s + the grace
        final = {o.request_id: o for o in outs if o.finished}
        assert set(final) == {"a", "b"} and {o.finish_reason for o in final.values()} == {"error"}
        assert len(final["a"].output_token_ids) == 3 == len(final["b"].output_token_ids)
        assert not g.healthy and not g.has_unfinished()
        with pytest.raises(DPRankError, match="data-parallel rank 1"):
            g.step()
        with pytest.raises(DPRankError):
            g.add_request("c", [1, 2, 3], GREEDY)
        load = g.load()  # the live rank answers; the gone one is None
        assert not load["healthy"] and "rank 1" in load["error"]
        live = load["ranks"][0]
        assert live["free_pages"] == live["total_pages"] and live["requests"] == 0
        if sig == signal.SIGKILL:
            assert load["ranks"][1] is None
    finally:
        if sig == signal.SIGSTOP:
            os.kill(g.pids[1], signal.SIGCONT)
        g.close()
    assert all(p.poll() is not None for p in g.procs)


def test_bad_dp_settings_are_named(moe_models, tiny_model_dir):
    from pdkv.config import Config
    from pdkv.config.validate import validate

    cfg_json = read_json(moe_models["qwen3_moe"] / "config.json")
    with pytest.raises(ConfigError, match=r"parallel.dp=3 must divide the 8 routed experts"):
        check_dp_model(ParallelConfig(dp=3, ep=True), cfg_json, "config.json")
    with pytest.raises(ConfigError, match=r"parallel.ep: true needs a mixture-of-experts model"):
        check_dp_model(ParallelConfig(dp=2, ep=True), read_json(tiny_model_dir / "config.json"), "config.json")
    check_dp_model(ParallelConfig(dp=4, ep=True), cfg_json, "config.json")  # 8 / 4: fine
    for parallel, field in [(ParallelConfig(dp=2), "parallel.ep"), (ParallelConfig(dp=2, ep=True, tp=2, expert_parallel=True), "parallel.expert_parallel"),
                            (ParallelConfig(ep=True), "parallel.ep"), (ParallelConfig(dp=0), "parallel.dp")]:
        with pytest.raises(ConfigError, match=field):
            validate(Config(parallel=parallel), {}, check_paths=False)
    assert rank_cpu_sets("0-4", 2) == ["0,1,2", "3,4"] and rank_cpu_sets("", 3) == ["", "", ""]
    with pytest.raises(ValueError, match=r"parallel.cpus='0' lists 1 CPU\(s\) for parallel.dp=2"):
        rank_cpu_sets("0", 2)
    t0 = time.monotonic()  # refused before any rank process starts
    with pytest.raises(ConfigError, match="parallel.dp=3"):
        DPGroup(ModelConfig(path=str(moe_models["deepseek_v3"])), KV, SCHED, ParallelConfig(dp=3, ep=True))
    assert time.monotonic() - t0 < 5
