"""The draft-model hand-off (pdkv/disagg/spec_handoff.py): the prefill node also prefills the
draft model and streams its KV into the decode node's draft cache (inside the same immediate
count), so the decode node drafts from its first step. A draft identical to the target accepts
every draft from that first step on (exactly k + 1 tokens per verification step); a smaller
random draft accepts little and output is still plain decoding's; draft pages of a failed
transfer go back only once no write can land, and then all of them."""
from __future__ import annotations

import threading

import pytest
import torch

from _cluster import Cluster, make_engine, node_config, post_completion, wait_for
from pdkv.engine import SamplingParams
from pdkv.server.app import NODE

K = 3


def _over(draft, **more):
    return {"speculative__method": "draft", "speculative__num_tokens": K,
            "speculative__draft_model": {"path": str(draft)}, "kv_cache__num_pages": 256, **more}


def _prompts():
    g = torch.Generator().manual_seed(11)
    return [torch.randint(0, 500, (n,), generator=g).tolist() for n in (4, 17, 33, 60)]


@pytest.fixture(scope="module")
def other_draft(tmp_path_factory):
    """The target's tokenizer and vocabulary, other random weights, half the width, one layer."""
    from pdkv.tiny_model import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("draft"), hidden_size=32, num_layers=1, num_heads=2,
                           num_kv_heads=1, seed=123)


@pytest.fixture(scope="module")
def plain(tiny_model_dir):
    return make_engine(node_config(tiny_model_dir, "colocated", kv_cache__num_pages=256))


def _complete(c, prompt, n):
    status, body = post_completion(c.url, {"model": c.model_name(), "prompt": list(prompt), "max_tokens": n,
                                           "temperature": 0, "ignore_eos": True, "return_token_ids": True}, 120)
    assert status == 200, body
    return body["choices"][0]["token_ids"]


def _batch(c, prompts, n):
    got = [None] * len(prompts)
    threads = [threading.Thread(target=lambda i=i: got.__setitem__(i, _complete(c, prompts[i], n)))
               for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    return got


def _idle(c):
    eng = c.decode_engine
    wait_for(lambda: c.pools_full() and eng.spec.proposer.num_pages_used == 0, 10,
             "every page back on both nodes and in the decode node's draft cache")
    assert not c.coordinator.spec._reserved and not c.coordinator.spec._landed


@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_self_draft_accepts_every_draft_from_the_first_step(tiny_model_dir, plain, transport):
    over = _over(tiny_model_dir, messenger__transport=transport)
    c = Cluster(tiny_model_dir, prefill_over=over, decode_over=over)
    try:
        eng = c.decode_engine
        hello = c.coordinator.hello.speculative
        assert hello == c.prefill.app[NODE].coordinator.hello.speculative and hello["method"] == "draft"
        first, real = {}, eng.runner.verify

        def verify(logits, req, drafts):
            first.setdefault(req.request_id, len(req.output_token_ids))
            return real(logits, req, drafts)
        eng.runner.verify = verify
        fed, hidden = [], eng.spec.proposer._hidden

        def observed(items):  # the decode node's draft model: what it is fed
            fed.extend(len(toks) for _, toks in items)
            return hidden(items)
        eng.spec.proposer._hidden = observed
        n = 6 * (K + 1)  # 6 full runs from the first decode step (the held-back token's) on
        prompts = _prompts()
        want = [o.output_token_ids for o in plain.generate(prompts, SamplingParams(max_tokens=n, temperature=0,
                                                                                   ignore_eos=True))]
        try:
            got = [_complete(c, p, n) for p in prompts]
        finally:
            eng.runner.verify = real
            eng.spec.proposer._hidden = hidden
        assert got == want
        # nothing of the prompt was prefilled here: the draft model was fed the held-back prompt
        # token, its own drafts one by one and, after a run, the last draft and the bonus token
        assert fed and max(fed) == 2, sorted(set(fed))
        st = eng.spec.stats
        assert sorted(first.values()) == [0] * len(prompts)  # each one's first step verified drafts
        assert st.num_drafts == 6 * len(prompts)
        assert st.accepted_length_counts[K + 1] == st.num_drafts  # every step emitted exactly k + 1
        assert st.acceptance_rate == 1.0
        _idle(c)
    finally:
        c.stop()


def test_small_random_draft_output_unchanged(tiny_model_dir, plain, other_draft):
    c = Cluster(tiny_model_dir, prefill_over=_over(other_draft), decode_over=_over(other_draft))
    try:
        prompts = _prompts()
        want = [o.output_token_ids for o in plain.generate(prompts, SamplingParams(max_tokens=20, temperature=0,
                                                                                   ignore_eos=True))]
        assert _batch(c, prompts, 20) == want
        st = c.decode_engine.spec.stats
        assert st.num_draft_tokens > 40 and st.acceptance_rate < 0.3
        assert _complete(c, prompts[1], 1) == want[1][:1]  # landed, never drafted for
        _idle(c)
    finally:
        c.stop()


def test_draft_pages_wait_for_the_writes_after_a_failed_transfer(tiny_model_dir, other_draft):
    c = Cluster(tiny_model_dir, prefill_faults=[("delay", 0, 0, 700_000)], prefill_over=_over(other_draft),
                decode_over=_over(other_draft, messenger__transfer_timeout_s=0.3))
    try:
        spec = c.coordinator.spec
        status, body = post_completion(c.url, {"model": c.model_name(), "prompt": _prompts()[2], "max_tokens": 4})
        assert status != 200 and "timed out" in body["error"]["message"], body
        assert spec.p.num_pages_used > 0  # the late writes have not landed yet
        wait_for(lambda: c.pools_full() and spec.p.num_pages_used == 0, 20, "every page back after the writes")
        assert not spec._reserved and not spec._landed
    finally:
        c.stop()


def test_tp2_prefill_to_tp1_decode_self_draft(tiny_model_dir, plain):
    """Prefill TP2 (its rank 0 prefills the draft model alone) -> decode TP1: greedy equality
    and every verification step emits k + 1 tokens from the first one on."""
    from _tp_pair import TP2ToTP1

    pair = TP2ToTP1(tiny_model_dir, _over(tiny_model_dir), _over(tiny_model_dir))
    try:
        n, prompts = 3 * (K + 1), _prompts()
        want = [o.output_token_ids for o in plain.generate(prompts, SamplingParams(max_tokens=n, temperature=0,
                                                                                   ignore_eos=True))]
        assert _batch(pair, prompts, n) == want
        st = pair.decode_engine.spec.stats
        assert st.num_drafts == 3 * len(prompts) and st.accepted_length_counts[K + 1] == st.num_drafts
        _idle(pair)
    finally:
        pair.stop()
