"""A TP2 prefill node (two rank processes, the MLA latent whole on each) into a DP2-EP decode
group over tcp: the PREFILL of each request names its decode rank and that rank's ranges; the
seed picks which prefill rank sends. Tokens equal a colocated TP1 engine's greedy tokens."""

from __future__ import annotations

from _dp_disagg import DP, PROMPTS, complete, dp_group, pools_back, together, reference  # noqa: F401

from _cluster import Cluster, wait_for
from pdkv.engine import LLMEngine


def _tp2(cfg):
    return LLMEngine.from_config(cfg, num_threads=1)  # pdkv.tp makes every rank's KV memory


def test_tp2_prefill_into_dp2_decode_over_tcp(moe_models, reference):
    want_tokens, _ = reference
    c = Cluster(moe_models["deepseek_v3"], prefill_over={"parallel__tp": 2, "parallel__timeout_s": 30.0},
                decode_over=DP, decode_engine=dp_group, prefill_engine=_tp2)
    group, stopped = c.decode_engine, None
    try:
        assert [(q.plan.prefill.tp, q.plan.decode.tp) for q in c.coordinator.peers] == [(2, 1)]
        name = c.model_name()
        got = [complete(c.url, name, PROMPTS[0])] + together(c.url, name, PROMPTS[1:], group=group)
        assert [g.get("choices", [{}])[0].get("token_ids") for g in got] == want_tokens, got
        assert sorted(group.remote_landed) == [1, 2]  # both ranks' pools received
        wait_for(lambda: not (group.rank_of or group._remote or c.coordinator.slots), 15, "every request ended")
        c.stop()
        stopped, c = c, None
        assert pools_back(group), group.load()["ranks"]
    finally:
        prefill = (c or stopped).prefill_engine
        if c is not None:
            c.stop()
        prefill.close()
        group.close()
