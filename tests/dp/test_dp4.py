"""DP4 with expert parallelism (four rank processes, two routed experts each) on DeepSeek-V3
(MLA): TP1's greedy tokens with two ranks idle for the whole run (dummy forwards only) and a long
prefill on a third beside decodes on the first."""

from __future__ import annotations

import pytest

from pdkv.config import KVCacheConfig, ModelConfig, ParallelConfig, SchedulerConfig
from pdkv.dp.group import DPGroup
from pdkv.engine import LLMEngine, SamplingParams

KV = KVCacheConfig(page_size=4, num_pages=64)
SCHED = SchedulerConfig(max_num_batched_tokens=24, chunk_size=8, max_num_seqs=4)
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


@pytest.mark.slow  # four rank processes: ~1 min to start on a loaded 2-core box, seconds to run
def test_dp4_ep_gives_tp1_greedy_tokens(moe_models):
    folder = moe_models["deepseek_v3"]
    prompts = [[7, 8, 9, 10, 11], list(range(200, 213)), list(range(3, 35))]
    one = LLMEngine(ModelConfig(path=str(folder)), KV, SCHED)
    ref = [o.output_token_ids for o in one.generate(prompts, GREEDY)]
    g = DPGroup(ModelConfig(path=str(folder)), KV, SCHED,
                ParallelConfig(dp=4, ep=True, timeout_s=60.0, startup_timeout_s=600.0))
    try:
        assert g.experts == [(0, 1), (2, 3), (4, 5), (6, 7)]
        g.add_request("a", prompts[0], GREEDY, rank=0)
        g.add_request("b", prompts[1], GREEDY, rank=0)
        for _ in range(3):
            g.step()
        g.add_request("c", prompts[2], GREEDY, rank=2)  # 4 chunks on rank 2 while rank 0 decodes
        final = {}
        while g.has_unfinished():
            final.update((o.request_id, o) for o in g.step() if o.finished)
        assert [final[r].output_token_ids for r in "abc"] == ref
        steps = g.steps
        assert g.dummy_steps[1] == g.dummy_steps[3] == steps  # never had work: a dummy every step
        assert g.dummy_steps[2] == 3 and g.dummy_steps[0] < steps
        load = g.load()
        assert load["total"]["free_pages"] == 4 * KV.num_pages
        assert load["total"]["pairs_sent"] == load["total"]["pairs_received"] > 0
    finally:
        g.close()
