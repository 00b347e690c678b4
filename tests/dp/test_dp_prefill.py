"""Disaggregated prefill on a DP2-EP group (DeepSeek-V3, MLA), over tcp (in-process nodes): the
prefill node's front places each PREFILL on a rank by load, that rank computes the prompt's
latent into its own pool (a shared-memory file the front registers) and bumps its layer
counter, and the front writes the pages into the decode node's grants. A long prompt keeps
prefill rank 0 busy so the next ones go to rank 1. Tokens equal a colocated TP1 engine's; the
landed latent equals that engine's cache, on the chosen decode rank only."""

from __future__ import annotations

import threading
import urllib.request

import pytest

from _dp_disagg import (DP, MAX_TOKENS, PROMPTS, complete, dp_group, match_kv, pools_back,  # noqa: F401
                        reference, together)

from _cluster import Cluster, colocated_tokens, hold_kv_on_landing, post_completion, wait_for

LONG = list(range(100, 250))  # 150 tokens, 10 chunks of 16 on its prefill rank


def _forwards(group) -> list[int]:
    """Each rank's real forward passes (call it with no engine thread driving the group)."""
    return [r["forwards"] for r in group.load()["ranks"]]


def test_dp2_prefill_into_dp2_decode_over_tcp(moe_models, reference):
    want_tokens, want_kv = reference
    folder = moe_models["deepseek_v3"]
    c = Cluster(folder, prefill_over=DP, decode_over=DP, prefill_engine=dp_group, decode_engine=dp_group)
    prefill, group, stopped = c.prefill_engine, c.decode_engine, False
    try:
        assert [(q.plan.prefill.tp, q.plan.decode.tp) for q in c.coordinator.peers] == [(1, 1)]
        landed = {}
        pools = [r.cache for r in group.dp_regions]

        def on_landed(rid, hidden):
            rank, pages = group._remote[rid], c.coordinator.by_rid[rid].kv_pages
            landed[rid] = (rank, match_kv(pools[rank], pages, want_kv), match_kv(pools[1 - rank], pages, want_kv))
        c.coordinator.on_landed = on_landed
        name = c.model_name()
        got = together(c.url, name, [LONG] + PROMPTS[1:], group=group)
        assert got[0]["choices"][0]["token_ids"] == colocated_tokens(folder, LONG, MAX_TOKENS)
        assert [g["choices"][0]["token_ids"] for g in got[1:]] == want_tokens[1:]
        # decode: the long one on rank 0, the two after it on rank 1 (load); each landed latent
        # is its prompt's, on that rank alone
        assert sorted(rank for rank, _, _ in landed.values()) == [0, 1, 1]
        assert sorted(m for _, mine, _ in landed.values() for m in mine) == [1, 2]
        assert all(not other for _, _, other in landed.values())
        first = complete(c.url, name, PROMPTS[0])  # alone: rank 0 on both nodes (a tie goes to the lowest)
        assert first["choices"][0]["token_ids"] == want_tokens[0]
        wait_for(lambda: not (group.rank_of or group._remote or c.coordinator.slots), 15, "every request ended")
        c.stop()
        stopped = True
        assert pools_back(group), group.load()["ranks"]
        assert pools_back(prefill), prefill.load()["ranks"]
        assert all(n > 0 for n in _forwards(prefill)), prefill.load()["ranks"]  # both prefill ranks computed
        assert prefill.dummy_steps[1] > 0  # idle while rank 0 computed the long prompt: the lock step held
    finally:
        if not stopped:
            c.stop()
        prefill.close()
        group.close()


def test_dp2_prefill_into_tp1_decode_over_tcp(moe_models, reference):
    """The decode node is a TP1 engine: a prefill DP rank writes as a TP1 node does (the
    plan's one pair); the latent that lands before the decode starts is the colocated one."""
    want_tokens, want_kv = reference
    folder = moe_models["deepseek_v3"]
    c = Cluster(folder, prefill_over=DP, prefill_engine=dp_group)
    prefill, stopped = c.prefill_engine, False
    try:
        seen = hold_kv_on_landing(c.coordinator, c.decode_engine)
        name = c.model_name()
        got = together(c.url, name, [LONG] + PROMPTS[1:], gap_s=0.02)
        assert got[0]["choices"][0]["token_ids"] == colocated_tokens(folder, LONG, MAX_TOKENS)
        assert [g["choices"][0]["token_ids"] for g in got[1:]] == want_tokens[1:]
        by_prompt = {prompt: kv for prompt, kv in seen.values()}
        for i in (1, 2):
            (kv,) = by_prompt[tuple(PROMPTS[i])]
            assert all(a.equal(b) for a, b in zip(kv, want_kv[i])), f"prompt {i}'s landed latent differs"
        # echo with logprobs: a rank would need the prompt's last token; refused by name
        status, body = post_completion(c.url, {"model": name, "prompt": PROMPTS[1], "max_tokens": 2,
                                               "echo": True, "logprobs": 1})
        assert status == 500 and "not computed by a prefill DP-EP group" in body["error"]["message"], body
        wait_for(lambda: not c.coordinator.slots, 15, "every transfer ended")
        c.stop()
        stopped = True
        a = c.decode_engine.allocator
        assert a.num_free == a.num_total
        assert pools_back(prefill), prefill.load()["ranks"]
        assert all(n > 0 for n in _forwards(prefill)), prefill.load()["ranks"]
        assert prefill.dummy_steps[1] > 0
    finally:
        if not stopped:
            c.stop()
        prefill.close()


@pytest.mark.parametrize("retries", [0, 2], ids=["fails", "prefilled-here"])
def test_a_prefill_rank_killed_mid_request(moe_models, retries):
    """FAULT (a rank process killed): the long prompt's prefill rank dies while computing it.
    The group fails its requests and is unhealthy; the prefill node drops its decode node, which
    computes the prompt itself (disagg.prefill_retries 2, disagg.local_fallback: no other prefill
    node is live) and answers the colocated tokens, or with retries 0 fails it with a 503; every
    decode page comes back, no rank waits forever. Bounded: the front sees the dead process at
    once, the surviving rank's all-to-all fails when the dead peer's connection closes (else
    after parallel.timeout_s, 30 s here)."""
    import os
    import signal
    import time

    folder = moe_models["deepseek_v3"]
    c = Cluster(folder, prefill_over=DP, prefill_engine=dp_group,
                decode_over={"disagg__local_fallback": True, "disagg__prefill_retries": retries})
    prefill, stopped = c.prefill_engine, False
    try:
        name = c.model_name()
        got: dict = {}
        t = threading.Thread(target=lambda: got.update(complete(c.url, name, LONG)))
        t0 = time.monotonic()
        t.start()
        wait_for(lambda: bool(prefill.rank_of), 30, "the long prompt placed on a prefill rank")
        (rank,) = prefill.rank_of.values()
        os.kill(prefill.procs[rank].pid, signal.SIGKILL)
        t.join(120)
        assert not t.is_alive(), "the request hangs"
        if retries:
            assert got["choices"][0]["token_ids"] == colocated_tokens(folder, LONG, MAX_TOKENS), got
        else:
            assert got["status"] == 503 and "the prefill node died" in got["error"], got
        assert time.monotonic() - t0 < 60
        metrics = urllib.request.urlopen(c.url + "/metrics").read().decode()
        assert ('pdkv_disagg_prefill_retries_total{cause="peer_dead",model_name="%s",role="decode",to="local"} '
                '%d.0' % (name, 1 if retries else 0)) in metrics, [x for x in metrics.splitlines() if "retr" in x]
        assert not prefill.healthy and f"rank {rank}" in str(prefill.error)
        wait_for(lambda: not c.coordinator.slots, 15, "every transfer ended")
        c.stop()
        stopped = True
        a = c.decode_engine.allocator
        assert a.num_free == a.num_total
    finally:
        if not stopped:
            c.stop()
        prefill.close()


def test_a_dp_sides_queue_pairs_cover_every_ranks_nics():
    """verbs over several NICs: a request leaves from (or lands on) the NICs of the rank it was
    placed on, so the QPs of a DP side cover every rank's NICs (the plan itself is TP1's one
    pair); both sides derive the same pairs."""
    from types import SimpleNamespace

    from pdkv.disagg.sharded import link_pairs, plan_link
    from pdkv.shard import KVGeometry, ShardSpec

    latent = KVGeometry(1, 40, 4, "float32", "HND", True, 1)
    pre, dec, dp2 = ShardSpec(1, latent, "prefill"), ShardSpec(1, latent, "decode"), {"size": 2, "ep": True}
    pre_m, dec_m = SimpleNamespace(rank_nics=[[0], [1]]), SimpleNamespace(rank_nics=[[2], [3]])  # NIC placements
    for dec_dp, dec_nics in ((None, [[2]]), (dp2, [[2], [3]])):
        dec_m.rank_nics = dec_nics
        pre_extra = {"shard": pre.to_wire(), "dp": dp2, "rank_nics": pre_m.rank_nics}
        dec_extra = {"shard": dec.to_wire(), "rank_nics": dec_nics, **({"dp": dec_dp} if dec_dp else {})}
        plan = plan_link(pre, "prefill", dec_extra, dp2)
        on_prefill = link_pairs(plan, "prefill", pre_m, dec_extra, dp2)
        on_decode = link_pairs(plan_link(dec, "decode", pre_extra, dec_dp), "decode", dec_m, pre_extra, dec_dp)
        want = {(p, d) for p in (0, 1) for d in sum(dec_nics, [])} | {(0, 0)}
        assert set(on_prefill) == want and set(on_decode) == {(d, p) for p, d in want}
