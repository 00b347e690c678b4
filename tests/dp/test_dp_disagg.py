"""Disaggregated decode on a DP2-EP group (DeepSeek-V3, MLA): a TP1 prefill node writes each
request's latent pages straight into the pool of the one rank the group placed it on, over tcp
(in-process nodes, both ranks' pools read through the front's mapping); the tokens equal a
colocated TP1 engine's, the landed pages equal that engine's cache, and the other rank's pool
is untouched. A transfer that times out on one rank fails that request alone; the other rank's
request finishes, and every page of both ranks comes back."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from _dp_disagg import (DP, MAX_TOKENS, PROMPTS, complete, dp_group, pools_back,  # noqa: F401
                        reference, together)
from _dp_disagg import match_kv as _match

from _cluster import Cluster, colocated_tokens, node_config, wait_for


def test_tp1_prefill_into_dp2_decode_over_tcp(moe_models, reference):
    want_tokens, want_kv = reference
    c = Cluster(moe_models["deepseek_v3"], decode_over=DP, decode_engine=dp_group)
    group = c.decode_engine
    try:
        assert group.dp_regions is not None and len(c.coordinator.kv.keys) == 2  # one region per rank's pool
        assert c.coordinator.peers[0].plan.decode.tp == 1  # each DP rank is a TP1 engine
        landed = {}  # rid -> (its rank, its pages)
        pools = [r.cache for r in group.dp_regions]

        def on_landed(rid, hidden):
            rank, pages = group._remote[rid], c.coordinator.by_rid[rid].kv_pages
            # what landed on the chosen rank is one prompt's latent; the other rank's pool holds
            # no prompt's KV at those page ids (it received no write of this request)
            landed[rid] = (rank, pages, _match(pools[rank], pages, want_kv), _match(pools[1 - rank], pages, want_kv))
        c.coordinator.on_landed = on_landed
        name = c.model_name()
        idle = group.pools.buffers[1].tensor().clone()
        first = complete(c.url, name, PROMPTS[0])  # alone: on rank 0 (every tie goes to the lowest rank)
        assert first["choices"][0]["token_ids"] == want_tokens[0]
        assert torch.equal(group.pools.buffers[1].tensor(), idle), "the idle rank's pool was written"
        got = together(c.url, name, PROMPTS[1:], group=group)  # together: one on each rank (load placement)
        assert [g["choices"][0]["token_ids"] for g in got] == want_tokens[1:]
        assert sorted(rank for rank, _, _, _ in landed.values()) == [0, 0, 1]
        assert sorted(m for _, _, mine, _ in landed.values() for m in mine) == [0, 1, 2]
        assert all(len(mine) == 1 and not other for _, _, mine, other in landed.values())
        # a one-token prompt has no KV to fetch: its rank computes it, nothing is sent
        one = complete(c.url, name, [7])
        assert one["choices"][0]["token_ids"] == colocated_tokens(moe_models["deepseek_v3"], [7], MAX_TOKENS)
        assert len(landed) == 3 and sum(group.remote_landed) == 3
        wait_for(lambda: not (group.rank_of or group._remote or c.coordinator.slots), 15, "every request ended")
        c.stop()
        c = None
        assert pools_back(group), group.load()["ranks"]  # the engine thread is gone: the ranks are ours
    finally:
        if c is not None:
            c.stop()
        group.close()


def test_remote_kv_timing_out_on_one_rank_fails_that_request_only(moe_models, reference):
    """FAKE transport (fault injection): the first request's first write lands 4 s late, past
    messenger.transfer_timeout_s (1.5 s); the request placed on the other rank meanwhile lands
    at once and decodes; the late one fails naming the timeout; both ranks' pages come back once
    the late write landed (the grants fence it until then)."""
    want_tokens, _ = reference
    c = Cluster(moe_models["deepseek_v3"], decode_over={**DP, "messenger__transfer_timeout_s": 1.5},
                decode_engine=dp_group, prefill_faults=[("delay", 0, 1, 4_000_000)])
    group = c.decode_engine
    try:
        name = c.model_name()
        got: dict = {}
        late = threading.Thread(target=lambda: got.setdefault("late", complete(c.url, name, PROMPTS[0])))
        late.start()
        wait_for(lambda: len(group._remote) == 1, 20, "the first request's pages reserved")
        (late_rank,) = group._remote.values()
        t0 = time.monotonic()
        ok = complete(c.url, name, PROMPTS[1])
        assert ok["choices"][0]["token_ids"] == want_tokens[1]
        assert time.monotonic() - t0 < 4.0  # it did not wait for the other rank's late write
        late.join(60)
        assert got["late"]["status"] == 500 and "timed out after 1.5 s" in got["late"]["error"], got["late"]
        assert late_rank == 0 and group.healthy
        wait_for(lambda: not (group.rank_of or group._remote or c.coordinator.slots or c.coordinator.memory.live),
                 15, "every request ended and its reservation released")
        assert not c.coordinator.held  # no range is granted any more
        c.stop()
        c = None
        assert pools_back(group), group.load()["ranks"]  # the engine thread is gone: the ranks are ours
    finally:
        if c is not None:
            c.stop()
        group.close()


def test_handshake_carries_the_dp_layout_and_refuses_a_pair_it_cannot_serve():
    """HELLO's extra.dp: a decode DP2-EP group pairs with a prefill TP group of any degree (each
    side plans TPn -> TP1, the latent replicated) and CONNECT then carries one key per DP rank; a
    prefill DP2-EP group pairs as a TP1 node would, with a decode DP group or a TP node; a DP side
    whose ranks are not tp=1, or a malformed layout, is refused naming both sides' layouts."""
    from pdkv.control import HandshakeRefused
    from pdkv.disagg.sharded import check_keys, plan_link
    from pdkv.shard import KVGeometry, ShardSpec

    latent = KVGeometry(1, 40, 4, "float32", "HND", True, 1)
    dec, dp2 = ShardSpec(1, latent, "decode"), {"size": 2, "ep": True}
    for tp in (1, 2):
        pre = ShardSpec(tp, latent, "prefill")
        on_decode = plan_link(dec, "decode", {"shard": pre.to_wire()}, dp2)
        on_prefill = plan_link(pre, "prefill", {"shard": dec.to_wire(), "dp": dp2})
        assert (on_decode.prefill.tp, on_decode.decode.tp) == (on_prefill.prefill.tp, on_prefill.decode.tp) == (tp, 1)
        assert check_keys(on_prefill, [11, 12], dp=2) == [11, 12]
        with pytest.raises(HandshakeRefused, match="expected 2 integer key"):
            check_keys(on_prefill, [11], dp=2)
    pre = ShardSpec(1, latent, "prefill")
    for dec_dp in (dp2, None):  # prefill DP2 -> decode DP2, prefill DP2 -> decode TP1
        on_decode = plan_link(dec, "decode", {"shard": pre.to_wire(), "dp": dp2}, dec_dp)
        peer = {"shard": dec.to_wire(), **({"dp": dec_dp} if dec_dp else {})}
        on_prefill = plan_link(pre, "prefill", peer, dp2)
        assert [(p.prefill_rank, p.decode_rank) for p in on_prefill.pairs] == [(0, 0)]
        assert (on_decode.prefill.tp, on_decode.decode.tp) == (1, 1)
    with pytest.raises(HandshakeRefused, match=r"from prefill dp=2 ep \(tp=2 per rank\) to decode dp=2 ep "
                                               r"\(tp=1 per rank\): a prefill DP rank must be tp=1"):
        plan_link(dec, "decode", {"shard": ShardSpec(2, latent, "prefill").to_wire(), "dp": dp2}, dp2)
    with pytest.raises(HandshakeRefused, match=r"from prefill dp=2 ep \(tp=1 per rank\) to decode dp=2 ep "
                                               r"\(tp=2 per rank\): a decode DP rank must be tp=1"):
        plan_link(pre, "prefill", {"shard": ShardSpec(2, latent, "decode").to_wire(), "dp": dp2}, dp2)
    with pytest.raises(HandshakeRefused, match="HELLO dp must be"):
        plan_link(ShardSpec(2, latent, "prefill"), "prefill", {"shard": dec.to_wire(), "dp": {"size": 0}})
