"""The MTP hand-off (pdkv/disagg/spec_handoff.py): the prefill node runs the MTP layer over the
prompt and streams its KV like one more layer plus o_{n-2} in the hidden-state row, so the
decode node drafts from its first step. Its first drafts, the MTP KV that landed and o_{n-2} are
what a colocated engine computes; greedy output equals plain decoding; proposer pages of requests
that fail or leave mid-transfer go back only once no write can land, and then all of them."""
from __future__ import annotations

import threading

import pytest
import torch

from _cluster import Cluster, make_engine, node_config, post_completion, read_kv, wait_for
from pdkv.engine import LLMEngine, SamplingParams

K = 3
MTP = {"speculative__method": "mtp", "speculative__num_tokens": K, "kv_cache__num_pages": 256}


@pytest.fixture(scope="module")
def mtp_dir(tmp_path_factory):
    from pdkv.tiny_model import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("mtp"), seed=0, num_nextn_predict_layers=1)


@pytest.fixture(scope="module", params=["tcp", "shm"])
def cluster(mtp_dir, request):
    over = {**MTP, "messenger__transport": request.param}
    c = Cluster(mtp_dir, prefill_over=over, decode_over=over)
    yield c
    c.stop()


def _greedy(n):
    return SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)


def _prompts():
    """Chunked 16 at a time; no length is 16 m + 1, where the colocated engine's first drafts
    would come from the chunk before the prompt's last token (it drafts at chunk boundaries)."""
    g = torch.Generator().manual_seed(2)
    return [torch.randint(0, 500, (n,), generator=g).tolist() for n in (5, 18, 30, 41)]


def _complete(c, prompt, n):
    status, body = post_completion(c.url, {"model": c.model_name(), "prompt": list(prompt), "max_tokens": n,
                                           "temperature": 0, "ignore_eos": True, "return_token_ids": True}, 120)
    assert status == 200, body
    return body["choices"][0]["token_ids"]


def _first_drafts(engine) -> dict:
    """Wraps engine.runner.verify: rid -> (output tokens then, drafts) of its first verification."""
    real, seen = engine.runner.verify, {}

    def verify(logits, req, drafts):
        seen.setdefault(req.request_id, (len(req.output_token_ids), list(drafts)))
        return real(logits, req, drafts)
    engine.runner.verify = verify
    seen["restore"] = lambda: setattr(engine.runner, "verify", real)
    return seen


def _colocated_state(mtp_dir, q):
    """A colocated MTP engine on Q: the MTP state after its prefill step (KV of positions
    0..len(Q)-1, the o that drafts), its first drafts, and its greedy output."""
    eng = LLMEngine.from_config(node_config(mtp_dir, "colocated", **MTP), num_threads=1)
    seen = _first_drafts(eng)
    eng.add_request("q", q, _greedy(10))
    state = None
    while eng.has_unfinished():
        eng.step()
        st = eng.spec.proposer.states.get("q")
        if state is None and st is not None and st.num_valid == len(q):  # the prompt's last chunk ran
            state = (read_kv(eng.spec.proposer.kv, st.pages, len(q)), st.last.reshape(-1).clone())
    return state, seen["q"]


def test_first_drafts_kv_and_row_equal_colocated(cluster, mtp_dir):
    _check_first_drafts(cluster, mtp_dir)


def _check_first_drafts(c, mtp_dir):
    """Per prompt: the decode node's first drafts, and the MTP KV and o_{n-2} that landed, equal
    a colocated engine's; the greedy output equals plain decoding's."""
    plain = make_engine(node_config(mtp_dir, "colocated", kv_cache__num_pages=256))
    coord = c.coordinator
    landed, real = {}, coord.spec.landed

    def on_landed(rid, o):  # event loop, every write of rid has landed; before the engine hears it
        landed[rid] = (read_kv(coord.spec.p.kv, coord.spec._reserved[rid][0], landed_len[0]), o.clone())
        real(rid, o)
    landed_len = [0]  # positions the hand-off carries: the prompt minus its held-back last token
    coord.spec.landed = on_landed
    seen = _first_drafts(c.decode_engine)
    try:
        for q in _prompts():
            # P = Q + [Q's greedy next token]: the colocated engine on Q samples P's last token
            # in its prefill, so its first verification step is the decode node's first on P
            g = plain.generate([q], _greedy(1))[0].output_token_ids[0]
            p = q + [g]
            (want_kv, want_o), (want_n, want_drafts) = _colocated_state(mtp_dir, q)
            landed.clear()
            landed_len[0] = len(q)
            got = _complete(c, p, 9)
            assert got == plain.generate([q], _greedy(10))[0].output_token_ids[1:]
            ((got_kv, got_o),) = landed.values()
            torch.testing.assert_close(got_o, want_o, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(got_kv[0], want_kv[0], rtol=1e-5, atol=1e-5)
            rid = next(r for r in landed)
            assert want_n == 1 and seen[rid] == (0, want_drafts), (seen[rid], want_drafts)
            assert len(want_drafts) == K
    finally:
        coord.spec.landed = real
        seen["restore"]()
    wait_for(c.pools_full, 10, "every page back on both nodes")
    assert coord.spec.p.num_pages_used == 0 and not coord.spec._reserved and not coord.spec._landed


def test_greedy_batch_equals_plain(cluster, mtp_dir):
    plain = make_engine(node_config(mtp_dir, "colocated", kv_cache__num_pages=256))
    prompts = _prompts()
    want = [o.output_token_ids for o in plain.generate(prompts, _greedy(20))]
    eng = cluster.decode_engine
    before = eng.spec.stats.num_draft_tokens
    got = [None] * len(prompts)
    threads = [threading.Thread(target=lambda i=i: got.__setitem__(i, _complete(cluster, prompts[i], 20)))
               for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert got == want
    assert eng.spec.stats.num_draft_tokens - before > 20
    # max_tokens 1: landed, never drafted for; its proposer pages go back when it leaves
    assert _complete(cluster, prompts[1], 1) == want[1][:1]
    wait_for(cluster.pools_full, 10, "every page back on both nodes")
    assert eng.spec.proposer.num_pages_used == 0


def test_mtp_pages_wait_for_the_writes_after_a_failed_transfer(mtp_dir):
    """FAKE transport, every prefill write 0.7 s late, transfer timeout 0.3 s: the client gets
    its error at once, but the request's proposer pages stay reserved while the late writes can
    still land (they are written into them), and all go back once the peer quiesced."""
    c = Cluster(mtp_dir, prefill_faults=[("delay", 0, 0, 700_000)], prefill_over=MTP,
                decode_over={**MTP, "messenger__transfer_timeout_s": 0.3})
    try:
        mtp = c.coordinator.spec
        status, body = post_completion(c.url, {"model": c.model_name(), "prompt": _prompts()[2], "max_tokens": 4})
        assert status != 200 and "timed out" in body["error"]["message"], body
        assert mtp.p.num_pages_used > 0  # the late writes have not landed yet
        wait_for(lambda: c.pools_full() and mtp.p.num_pages_used == 0, 20, "every page back after the writes")
        assert not mtp._reserved and not mtp._landed
    finally:
        c.stop()


@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_tp2_prefill_to_tp1_decode_first_drafts_equal_colocated(mtp_dir, transport):
    """Prefill TP2 (rank 0 runs the MTP layer alone over the sharded target's hidden states) ->
    decode TP1: the same first drafts, MTP KV and row as a colocated engine, greedy equality."""
    from _tp_pair import TP2ToTP1

    over = {**MTP, "messenger__transport": transport}
    pair = TP2ToTP1(mtp_dir, over, over)
    try:
        _check_first_drafts(pair, mtp_dir)
    finally:
        pair.stop()
