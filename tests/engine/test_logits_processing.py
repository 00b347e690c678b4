"""Penalties, logit_bias, min_tokens, bad words and allowed tokens: greedy tokens equal a
reference written from vLLM's formulas over transformers' logits of the same sequence, with and
without ngram speculation (the verified rows see the drafts before them); bad values are refused
naming the field."""

from __future__ import annotations

import pytest
import torch

from pdkv.config import KVCacheConfig, ModelConfig, SchedulerConfig, SpeculativeConfig
from pdkv.engine import LLMEngine, SamplingParams
from pdkv.errors import InvalidRequest

PROMPT = [5, 9, 17, 5, 9, 17, 5, 9, 17, 40, 41, 5, 9, 17, 5, 9]  # repetitive: ngram drafts


def _engine(path, spec=None):
    return LLMEngine(ModelConfig(path=str(path)), KVCacheConfig(page_size=16, num_pages=128), SchedulerConfig(),
                     speculative=spec)


@pytest.fixture(scope="module")
def engines(tiny_model_dir):
    return _engine(tiny_model_dir), _engine(tiny_model_dir, SpeculativeConfig(method="ngram", num_tokens=4))


@pytest.fixture(scope="module")
def hf_logits(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32).eval()

    def logits(ids: list[int]) -> torch.Tensor:  # [len(ids), V]: row i scores token i + 1
        with torch.no_grad():
            return model(torch.tensor([ids])).logits[0].float()
    return logits


def _reference_step(x: torch.Tensor, prompt: list[int], out: list[int], p: SamplingParams, eos) -> int:
    """One greedy choice from raw logits ``x`` [V], written element by element from the formulas."""
    x = x.clone().tolist()
    V = len(x)
    if p.allowed_token_ids is not None:
        x = [v if t in p.allowed_token_ids else float("-inf") for t, v in enumerate(x)]
    if len(out) < p.min_tokens:
        for t in set(eos) | set(p.stop_token_ids):
            x[t] = float("-inf")
    for w in p.bad_words_ids:
        if len(w) == 1 or out[len(out) - len(w) + 1:] == w[:-1]:
            x[w[-1]] = float("-inf")
    for t, b in p.logit_bias.items():
        x[t] += b
    seen = set(prompt) | set(out)
    for t in range(V):
        if p.repetition_penalty != 1.0 and t in seen:
            x[t] = x[t] / p.repetition_penalty if x[t] > 0 else x[t] * p.repetition_penalty
        c = out.count(t)
        x[t] -= p.frequency_penalty * c + p.presence_penalty * (c > 0)
    return max(range(V), key=lambda t: x[t])


CASES = {
    "frequency": dict(frequency_penalty=1.5),
    "presence": dict(presence_penalty=-1.2),
    "repetition": dict(repetition_penalty=1.8),
    "all_three": dict(frequency_penalty=0.7, presence_penalty=0.9, repetition_penalty=1.3),
    "bias_and_bad_words": dict(logit_bias={7: 4.0, 11: -3.0, 300: 2.5}, bad_words_ids=[[7, 7], [300]]),
    "allowed_min_tokens": dict(allowed_token_ids=[3, 7, 11, 5, 9, 17], min_tokens=10, stop_token_ids=[11]),
}


@pytest.mark.parametrize("case", list(CASES))
def test_greedy_tokens_equal_the_reference_with_and_without_spec(engines, hf_logits, case):
    plain, spec = engines
    p = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, **CASES[case])
    [out] = plain.generate([PROMPT], p)
    tokens = out.output_token_ids
    raw = hf_logits(PROMPT + tokens)
    eos = plain.tokenizer.eos_token_ids if not p.ignore_eos else ()
    ref = []
    for i in range(len(tokens)):
        ref.append(_reference_step(raw[len(PROMPT) - 1 + i], PROMPT, ref, p, eos))
        if ref[-1] != tokens[i]:
            break
    assert tokens == ref
    [spec_out] = spec.generate([PROMPT], p)
    assert spec_out.output_token_ids == tokens
    # Penalties make ngram drafts rare; a stand-in proposer that drafts the known continuation,
    # one draft in three wrong, verifies long runs through the processors.
    real = spec.spec.proposer
    spec.spec.proposer = ContinuationProposer(tokens)
    try:
        before = spec.stats()["spec_num_accepted_tokens"]
        [spec_out] = spec.generate([PROMPT], p)
        assert spec.stats()["spec_num_accepted_tokens"] > before
    finally:
        spec.spec.proposer = real
    assert spec_out.output_token_ids == tokens


class ContinuationProposer:
    """A test stand-in proposer: drafts the given continuation, every third draft off by one."""

    def __init__(self, tokens: list[int]):
        self.tokens = tokens

    def propose(self, reqs, nums):
        out = []
        for r, n in zip(reqs, nums):
            at = len(r.output_token_ids)
            d = self.tokens[at:at + n]
            out.append([t + 1 if (at + i) % 3 == 2 else t for i, t in enumerate(d)])
        return out

    def finished(self, req):
        pass


def test_spec_accepts_drafts_through_the_penalties(engines):
    """The spec comparison above is not vacuous: with a light penalty drafts are accepted."""
    _, spec = engines
    before = spec.stats()["spec_num_accepted_tokens"]
    p = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, repetition_penalty=1.01)
    spec.generate([PROMPT * 3], p)
    assert spec.stats()["spec_num_accepted_tokens"] > before


def test_min_tokens_holds_back_eos(engines):
    plain, _ = engines
    eos = next(iter(plain.tokenizer.eos_token_ids))
    p = SamplingParams(max_tokens=8, temperature=0, min_tokens=5, logit_bias={eos: 100.0})
    [out] = plain.generate([PROMPT], p)
    assert len(out.output_token_ids) == 6 and out.output_token_ids[-1] == eos
    assert out.finish_reason == "stop"
    p.skip_special_tokens = False  # (as with a tool parser) special tokens in the text, yet not the EOS
    [kept] = plain.generate([PROMPT], p)
    assert kept.output_token_ids == out.output_token_ids and kept.text == out.text
    assert plain.tokenizer.decode([eos], skip_special_tokens=False) not in kept.text


@pytest.mark.parametrize("field,value,named", [
    ("presence_penalty", 3.0, "presence_penalty"), ("repetition_penalty", 0.0, "repetition_penalty"),
    ("logit_bias", {5: 101.0}, "logit_bias[5]"), ("logit_bias", {100000: 1.0}, "vocabulary"),
    ("min_tokens", -1, "min_tokens"), ("bad_words_ids", [[]], "bad_words"),
    ("allowed_token_ids", [9999], "vocabulary"), ("logprobs", 21, "logprobs")])
def test_bad_values_are_refused_naming_the_field(engines, field, value, named):
    plain, _ = engines
    with pytest.raises(InvalidRequest, match=named.replace("[", r"\[")):
        plain.validate_request(PROMPT, SamplingParams(**{field: value}))
