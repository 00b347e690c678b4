"""The ``draft`` proposer: a draft with the target's own weights accepts every draft (each
verification step emits exactly k + 1 tokens), a random draft accepts almost nothing, and in
both cases greedy output is token for token what plain decoding gives; the draft's own KV pool
returns to empty; a draft with another vocabulary or tokenizer fails at start-up naming both."""

from __future__ import annotations

import pytest
import torch

from pdkv.config import ConfigError, DraftModelConfig, KVCacheConfig, ModelConfig, SchedulerConfig, SpeculativeConfig
from pdkv.engine import LLMEngine, SamplingParams

K = 3


def _engine(path, draft=None, page_size=16):
    spec = SpeculativeConfig(method="draft", num_tokens=K, draft_model=DraftModelConfig(path=str(draft))) \
        if draft is not None else None
    return LLMEngine(ModelConfig(path=str(path)), KVCacheConfig(page_size=page_size, num_pages=512),
                     SchedulerConfig(), speculative=spec)


def _prompts():
    g = torch.Generator().manual_seed(11)
    return [torch.randint(0, 500, (n,), generator=g).tolist() for n in (4, 17, 33, 60)]


@pytest.fixture(scope="module")
def plain(tiny_model_dir):
    return _engine(tiny_model_dir)


@pytest.fixture(scope="module")
def other_draft(tmp_path_factory):
    """Same tokenizer and vocabulary as the target (the generator trains it deterministically),
    other random weights, half the width."""
    from pdkv.tiny_model import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("draft"), hidden_size=32, num_layers=1, num_heads=2,
                           num_kv_heads=1, seed=123)


def test_self_draft_accepts_everything(tiny_model_dir, plain):
    eng = _engine(tiny_model_dir, draft=tiny_model_dir, page_size=4)
    n = 1 + 6 * (K + 1)  # the prefill's token + 6 full runs: no run is cut short by max_tokens
    params = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
    prompts = _prompts()
    want = [o.output_token_ids for o in plain.generate(prompts, params)]
    assert [o.output_token_ids for o in eng.generate(prompts, params)] == want
    st = eng.spec.stats
    assert st.num_drafts == 6 * len(prompts)
    assert st.accepted_length_counts[K + 1] == st.num_drafts  # every step emitted exactly k + 1
    assert st.acceptance_rate == 1.0
    assert eng.spec.proposer.num_pages_used == 0 and eng.allocator.num_free == eng.allocator.num_total


def test_self_draft_counts_every_position_exactly(tiny_model_dir, plain):
    """Every draft accepted, the last run cut short by max_tokens: per prompt two runs of K
    drafts, then one of a single draft (2 tokens were left: 1 draft + the target's token), so
    per position [3, 2, 2] accepted, lengths K + 1 twice and 2 once -- counted from what is known
    of the run, not from the counters themselves."""
    eng = _engine(tiny_model_dir, draft=tiny_model_dir, page_size=4)
    n = 1 + 2 * (K + 1) + 2
    params = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
    prompts = _prompts()
    want = [o.output_token_ids for o in plain.generate(prompts, params)]
    assert [o.output_token_ids for o in eng.generate(prompts, params)] == want
    st, P = eng.spec.stats, len(prompts)
    assert st.num_drafts == 3 * P and st.num_draft_tokens == (2 * K + 1) * P
    assert st.accepted_per_pos == [3 * P, 2 * P, 2 * P]
    assert sum(st.accepted_per_pos) == st.num_accepted_tokens == (2 * K + 1) * P
    assert st.accepted_length_counts == [0, 0, P, 0, 2 * P]
    d = eng.stats()
    assert d["spec_acceptance_rate_per_pos"] == [1.0, 2 / 3, 2 / 3]
    assert d["spec_mean_accepted_length"] == pytest.approx(1 + (2 * K + 1) / 3)


def test_random_draft_accepts_almost_nothing_and_output_is_unchanged(tiny_model_dir, plain, other_draft):
    eng = _engine(tiny_model_dir, draft=other_draft)
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    prompts = _prompts()
    want = [o.output_token_ids for o in plain.generate(prompts, params)]
    assert [o.output_token_ids for o in eng.generate(prompts, params)] == want
    st = eng.spec.stats
    assert st.num_draft_tokens > 40 and st.acceptance_rate < 0.15
    assert eng.spec.proposer.num_pages_used == 0 and eng.allocator.num_free == eng.allocator.num_total


def test_sampled_requests_and_aborts_free_the_draft_pool(tiny_model_dir, other_draft):
    eng = _engine(tiny_model_dir, draft=tiny_model_dir, page_size=4)
    params = SamplingParams(max_tokens=24, temperature=0.9, seed=5, ignore_eos=True)
    for i, p in enumerate(_prompts()):
        eng.add_request(f"r{i}", p, params)
    for _ in range(4):
        eng.step()
    assert eng.spec.proposer.num_pages_used > 0
    eng.abort("r0")
    eng.abort("r2")
    done = {}
    while eng.has_unfinished():
        done.update({o.request_id: o for o in eng.step() if o.finished})
    assert {r: len(o.output_token_ids) for r, o in done.items() if r in ("r1", "r3")} == {"r1": 24, "r3": 24}
    assert eng.spec.stats.num_draft_tokens > 0
    assert eng.spec.proposer.num_pages_used == 0 and eng.allocator.num_free == eng.allocator.num_total


def test_draft_with_another_vocabulary_fails_naming_both(tiny_model_dir, tmp_path):
    from pdkv.tiny_model import make_tiny_model

    small = make_tiny_model(tmp_path / "v384", vocab_size=384)
    with pytest.raises(ConfigError, match=r"draft model .*v384 has vocab_size 384, the target .* has 512"):
        _engine(tiny_model_dir, draft=small)


def test_draft_with_another_tokenizer_fails_naming_both(tiny_model_dir, tmp_path):
    import json
    import shutil

    other = tmp_path / "othertok"
    shutil.copytree(tiny_model_dir, other)
    tok = json.loads((other / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    a, b = list(vocab)[300:302]
    vocab[a], vocab[b] = vocab[b], vocab[a]  # same size, two ids swapped
    (other / "tokenizer.json").write_text(json.dumps(tok))
    with pytest.raises(ConfigError, match=r"draft model .*othertok has another tokenizer than the target"):
        _engine(tiny_model_dir, draft=other)


def test_draft_method_needs_a_path(tiny_model_dir):
    with pytest.raises(ConfigError, match="speculative.draft_model.path"):
        LLMEngine(ModelConfig(path=str(tiny_model_dir)), KVCacheConfig(num_pages=64), SchedulerConfig(),
                  speculative=SpeculativeConfig(method="draft"))
