"""Data-parallel attention with expert-parallel MoE (pdkv/dp): a DP2 group (two real rank
processes over gloo, each its own engine and cache, routed experts split 4 + 4) gives exactly the
greedy tokens of one TP1 engine for Qwen3-MoE and DeepSeek-V3 (MLA), with requests spread
unevenly (a rank idle for several steps runs dummy forwards; a long prefill on one rank while the
other decodes); every routed expert lives on one rank; the all-to-all moves exactly the (token,
expert) pairs the router chose, counted against a pure-Python recomputation from a TP1 engine's
router; an abort on one rank mid-run leaves the other's tokens unchanged and every page back.

The groups are built once per module (starting a rank process costs seconds on a loaded box)."""

from __future__ import annotations

import pytest

from pdkv.config import KVCacheConfig, ModelConfig, ParallelConfig, SchedulerConfig
from pdkv.engine import LLMEngine, SamplingParams

from _dp_groups import check_abort_mid_run, check_uneven_run_finishes, reference, run_all, start_groups

# Small chunks: a long prompt takes several steps, so its prefill chunks share steps with decodes.
KV = KVCacheConfig(page_size=4, num_pages=96)
SCHED = SchedulerConfig(max_num_batched_tokens=24, chunk_size=8, max_num_seqs=4)
GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
SHORT = [[7, 8, 9, 10, 11], [5, 6, 7], list(range(200, 213))]
LONG = list(range(3, 43))  # 40 tokens: 5 chunks


@pytest.fixture(scope="module")
def groups(moe_models):
    yield from start_groups(moe_models, KV, SCHED, ParallelConfig(dp=2, ep=True, timeout_s=30.0,
                                                                  startup_timeout_s=300.0))


def _reference(folder, prompts):
    return reference(folder, prompts, KV, SCHED, GREEDY)


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3"])
def test_dp2_ep_gives_tp1_greedy_tokens_with_uneven_ranks(family, groups, moe_models):
    g = groups[family]
    ref = _reference(moe_models[family], SHORT + [LONG])
    dummies = list(g.dummy_steps)
    # Phase 1: rank 0 alone has work; rank 1 runs dummy forwards (it must join every all-to-all).
    for i, p in enumerate(SHORT):
        assert g.add_request(f"{family}-s{i}", p, GREEDY, rank=0) == 0
    for _ in range(4):
        g.step()
    assert g.dummy_steps[1] - dummies[1] == 4 and g.dummy_steps[0] == dummies[0]
    # Phase 2: a long prefill on rank 1 while rank 0 decodes: the same steps carry both.
    g.add_request(f"{family}-long", LONG, GREEDY, rank=1)
    mixed = 0
    for _ in range(4):  # its 5 chunks take 5 steps: no token of it yet, rank 0's decodes go on
        outs = g.step()
        assert not any(o.request_id == f"{family}-long" and o.new_token_ids for o in outs)
        mixed += any(o.request_id.startswith(f"{family}-s") and o.new_token_ids for o in outs)
    assert mixed == 4 and g.dummy_steps[1] - dummies[1] == 4  # rank 1 computed: no more dummies
    check_uneven_run_finishes(g, family, len(SHORT), ref, KV.num_pages, 4)


def test_each_routed_expert_lives_on_exactly_one_rank(groups):
    for g in groups.values():
        assert g.experts == [tuple(range(0, 4)), tuple(range(4, 8))]


def test_all_to_all_moves_exactly_the_pairs_the_router_chose(groups, moe_models):
    """One request on rank 0, rank 1 idle: each forward of rank 0 has the tokens a TP1 engine has
    for the same request, so its router's choices (recorded in the TP1 engine) say how many pairs
    each expert must get; rank 0 must send exactly those, rank 1 nothing, and each rank must receive
    the pairs for its own experts."""
    from pdkv.models.moe import Router

    family, prompt = "deepseek_v3", list(range(50, 71))  # 21 tokens: 3 prefill chunks, then decodes
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    one = LLMEngine(ModelConfig(path=str(moe_models[family])), KV, SCHED)
    chosen = []  # per router call (forward-major, layer-minor): the ids as Python lists
    for layer in one.loaded.model.model.layers:
        gate = getattr(layer.mlp, "gate", None)
        if isinstance(gate, Router):
            real = gate.forward
            gate.forward = lambda x, real=real: chosen.append(real(x)[0].tolist()) or real(x)
    ref = one.generate([prompt], params)[0].output_token_ids
    g = groups[family]
    g.record(True)
    try:
        got = g.generate([prompt], params, ranks=[0])[0].output_token_ids
    finally:
        logs = g.record(False)
    assert got == ref
    sent0 = [counts for _, _, counts, _ in logs[0]]
    assert len(sent0) == len(chosen) == len(logs[1]) > 0
    for i, ids in enumerate(chosen):
        expect = [0] * 8
        for token in ids:
            for e in token:
                expect[e] += 1
        assert sent0[i] == expect, f"router call {i}"
        assert logs[1][i][2] == [0] * 8  # the idle rank's dummy forward sends nothing
        # What each rank received from rank 0: the pairs of its own experts, no more, no less.
        assert logs[0][i][3] == [sum(expect[:4]), 0] and logs[1][i][3] == [sum(expect[4:]), 0]
        assert logs[0][i][:2] == logs[1][i][:2]  # both ranks at the same forward and layer


def test_abort_on_one_rank_mid_run(groups, moe_models):
    family = "qwen3_moe"
    check_abort_mid_run(groups[family], _reference(moe_models[family], [SHORT[0]])[0], SHORT[0], LONG, GREEDY, 2)


def test_placement_by_load_and_prefix_affinity(groups):
    g = groups["qwen3_moe"]
    before = g.placer.placed_by_affinity
    p = list(range(300, 324))  # 6 full pages
    ra = g.add_request("a", p, GREEDY)
    rb = g.add_request("b", list(range(400, 410)), GREEDY)
    assert rb != ra  # by load: the other rank is idle
    rc = g.add_request("c", p + [1, 2], GREEDY)  # the same first pages: where they were cached
    assert rc == ra and g.placer.placed_by_affinity == before + 1
    run_all(g)


def test_one_endpoint_serves_the_group(groups, moe_models):
    """The group's front behind the OpenAI server: completions equal TP1's greedy tokens, /load
    and /metrics report each rank and the sum, /health is ok."""
    import asyncio
    import json

    import aiohttp

    from pdkv.config import load_config
    from pdkv.server import ServerThread

    family = "qwen3_moe"
    g = groups[family]
    prompts = [SHORT[0], SHORT[2]]
    ref = _reference(moe_models[family], prompts)
    cfg = load_config(None, [f"model.path={moe_models[family]}", "server.port=0", "parallel.dp=2", "parallel.ep=true"])
    thread = ServerThread(cfg, g).start()
    try:
        async def go():
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as s:
                async def one(p):
                    body = {"model": g.model_name, "prompt": p, "max_tokens": GREEDY.max_tokens, "temperature": 0,
                            "ignore_eos": True, "return_token_ids": True}
                    async with s.post(thread.url + "/v1/completions", data=json.dumps(body),
                                      headers={"Content-Type": "application/json"}) as r:
                        return r.status, await r.json()
                outs = await asyncio.gather(*(one(p) for p in prompts))
                async with s.get(thread.url + "/load") as r:
                    load = await r.json()
                async with s.get(thread.url + "/metrics") as r:
                    metrics = await r.text()
                async with s.get(thread.url + "/health") as r:
                    health = r.status
                return outs, load, metrics, health
        outs, load, metrics, health = asyncio.run(go())
    finally:
        thread.stop()
    assert all(status == 200 for status, _ in outs), outs
    texts = [g.tokenizer.decode(r) for r in ref]
    assert [body["choices"][0]["text"] for _, body in outs] == texts
    assert load["dp"] == 2 and len(load["ranks"]) == 2 and health == 200
    assert load["num_pages_total"] == sum(r["num_pages_total"] for r in load["ranks"]) == 2 * KV.num_pages
    rows = [line for line in metrics.splitlines() if line.startswith("pdkv_dp_rank_num_pages_total{")]
    assert len(rows) == 2 and all(line.endswith(f" {float(KV.num_pages)}") for line in rows)
    assert 'dp_rank="0"' in rows[0] + rows[1] and 'dp_rank="1"' in rows[0] + rows[1]
