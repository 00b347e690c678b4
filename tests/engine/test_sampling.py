"""Sampler and stop conditions: seeds, top-k/top-p limits, stop ids, stop strings, eos, length."""

from __future__ import annotations

import dataclasses

import pytest

from pdkv.engine import SamplingParams

PROMPT = [5, 17, 99, 240, 3, 77]


def _greedy(engine, n=12):
    return engine.generate([PROMPT], SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))[0]


def test_seed_gives_same_tokens_whatever_the_batch(base_engine):
    p = SamplingParams(max_tokens=16, temperature=1.0, seed=1234, ignore_eos=True)
    alone = base_engine.generate([PROMPT], p)[0].output_token_ids
    other = SamplingParams(max_tokens=16, temperature=1.0, ignore_eos=True)
    batched = base_engine.generate([[9, 9, 9], PROMPT, [1, 2]], [other, p, other])[1].output_token_ids
    assert alone == batched
    different = base_engine.generate([PROMPT], SamplingParams(max_tokens=16, temperature=1.0, seed=99,
                                                              ignore_eos=True))[0].output_token_ids
    assert different != alone


def test_top_k_1_and_tiny_top_p_are_greedy(base_engine):
    greedy = _greedy(base_engine).output_token_ids
    for p in (SamplingParams(max_tokens=12, temperature=1.5, top_k=1, ignore_eos=True),
              SamplingParams(max_tokens=12, temperature=1.5, top_p=1e-6, ignore_eos=True)):
        assert base_engine.generate([PROMPT], p)[0].output_token_ids == greedy
    hot = SamplingParams(max_tokens=12, temperature=5.0, seed=0, ignore_eos=True)
    assert base_engine.generate([PROMPT], hot)[0].output_token_ids != greedy


def test_stop_token_ids_and_eos(base_engine):
    greedy = _greedy(base_engine).output_token_ids
    stop_at = greedy[4]
    first = greedy.index(stop_at)
    out = base_engine.generate([PROMPT], SamplingParams(max_tokens=12, temperature=0, stop_token_ids=[stop_at]))[0]
    assert out.output_token_ids == greedy[:first + 1] and out.finish_reason == "stop"
    saved = set(base_engine.tokenizer.eos_token_ids)
    try:
        base_engine.tokenizer.eos_token_ids = {stop_at}
        out = base_engine.generate([PROMPT], SamplingParams(max_tokens=12, temperature=0))[0]
        assert out.output_token_ids == greedy[:first + 1] and out.finish_reason == "stop"
        out = base_engine.generate([PROMPT], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))[0]
        assert out.output_token_ids == greedy and out.finish_reason == "length"
    finally:
        base_engine.tokenizer.eos_token_ids = saved


def test_stop_string_truncates_and_is_never_streamed(base_engine):
    full = _greedy(base_engine, 24)
    text = full.text
    stop = text[len(text) // 2:len(text) // 2 + 3]
    assert len(stop) == 3 and "\ufffd" not in stop
    cut = text.index(stop)
    p = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, stop=[stop])
    streamed = list(base_engine.stream(PROMPT, p))
    assert streamed[-1].finished and streamed[-1].finish_reason == "stop"
    assert "".join(o.new_text for o in streamed) == text[:cut] == streamed[-1].text
    assert base_engine.allocator.num_free == base_engine.allocator.num_total


def test_stream_deltas_add_up(base_engine):
    p = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    deltas = list(base_engine.stream(PROMPT, p))
    final = base_engine.generate([PROMPT], p)[0]
    assert [t for d in deltas for t in d.new_token_ids] == final.output_token_ids
    assert "".join(d.new_text for d in deltas) == final.text
    assert [d.finished for d in deltas] == [False] * 9 + [True]
    assert deltas[-1].finish_reason == "length" and deltas[-1].num_output_tokens == 10


def test_closing_a_stream_early_aborts_and_frees(base_engine):
    it = base_engine.stream(PROMPT, SamplingParams(max_tokens=50, temperature=0, ignore_eos=True))
    next(it)
    next(it)
    it.close()
    base_engine.step()  # drains the abort output
    assert not base_engine.has_unfinished()
    assert base_engine.allocator.num_free == base_engine.allocator.num_total


def test_max_tokens_and_context_limit(make_engine):
    from pdkv.errors import InvalidRequest

    engine = make_engine(max_model_len=20)
    out = engine.generate([[1] * 15], SamplingParams(max_tokens=5, temperature=0, ignore_eos=True))[0]
    assert out.finish_reason == "length" and out.num_output_tokens == 5  # 15 + 5: exactly the limit
    # one token over the limit, by the prompt or by max_tokens: refused up front, naming the sum
    for prompt_len, max_tokens in ((15, 6), (20, 1)):
        with pytest.raises(InvalidRequest, match=rf"prompt \({prompt_len} tokens\) \+ max_tokens "
                                                 rf"\({max_tokens}\) = {prompt_len + max_tokens} exceeds "
                                                 r"the model's context of 20 tokens"):
            engine.add_request(f"over-{prompt_len}-{max_tokens}", [1] * prompt_len,
                               SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))
    # a prompt that alone is longer than the context is named as such (the check every role shares)
    with pytest.raises(InvalidRequest, match=r"prompt \(21 tokens\) exceeds the model's context of 20 tokens"):
        engine.add_request("over-21-1", [1] * 21, SamplingParams(max_tokens=1, temperature=0, ignore_eos=True))
    assert not engine.has_unfinished() and engine.allocator.num_free == engine.allocator.num_total
    out = engine.generate([[1] * 19], SamplingParams(max_tokens=1, temperature=0, ignore_eos=True))[0]
    assert out.num_output_tokens == 1  # and 19 + 1 still fits


def test_filter_logits_top_k_top_p_per_row():
    import torch

    from pdkv.engine.sampler import filter_logits

    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05], [0.1, 0.2, 0.3, 0.4], [0.25, 0.25, 0.25, 0.25]]))
    x = filter_logits(logits, torch.ones(3), torch.tensor([2, 4, 4]), torch.tensor([1.0, 0.6, 1.0]))
    kept = torch.isfinite(x)
    assert kept.tolist() == [[True, True, False, False], [False, False, True, True], [True] * 4]
    hot = filter_logits(logits, torch.full((3,), 2.0), torch.full((3,), 4), torch.ones(3))
    assert torch.allclose(hot, logits / 2)


def test_mixed_batch_of_sampling_settings(base_engine):
    """Greedy, huge top_k, top_k, top_p and seeded rows in one step; seeded rows reproduce."""
    ps = [SamplingParams(max_tokens=6, temperature=0, ignore_eos=True),
          SamplingParams(max_tokens=6, temperature=0.8, top_k=10**6, seed=3, ignore_eos=True),
          SamplingParams(max_tokens=6, temperature=0.8, top_k=5, seed=4, ignore_eos=True),
          SamplingParams(max_tokens=6, temperature=0.8, top_p=0.5, seed=5, ignore_eos=True)]
    first = base_engine.generate([PROMPT] * 4, ps)
    again = base_engine.generate([PROMPT] * 4, ps)
    assert [o.output_token_ids for o in first] == [o.output_token_ids for o in again]
    assert first[0].output_token_ids == _greedy(base_engine, 6).output_token_ids
    negative_seed = SamplingParams(max_tokens=3, temperature=1.0, seed=-7, ignore_eos=True)
    assert base_engine.generate([PROMPT], negative_seed)[0].num_output_tokens == 3


def test_unseeded_rows_draw_together_seeded_rows_alone():
    """The rows without a seed take one draw from the sampler's stream for all of them; a seeded
    row's token depends only on its own generator, not on the unseeded rows beside it."""
    import types

    import torch

    from pdkv.engine.sampler import Sampler

    V = 50
    logits = torch.randn(5, V, generator=torch.Generator().manual_seed(0))
    params = SamplingParams(temperature=1.0)
    greedy = SamplingParams(temperature=0)

    def req(p, seed=None):  # a seeded request's generator is re-seeded per token from (seed, position)
        gen = None if seed is None else torch.Generator()
        p = p if seed is None else dataclasses.replace(p, seed=seed)
        return types.SimpleNamespace(params=p, generator=gen, resumed_ids=[], output_token_ids=[])

    batch = [req(params), req(greedy), req(params, seed=7), req(params), req(params)]
    out = Sampler(seed=3)(logits, batch)
    assert out[1] == int(logits[1].argmax())
    alone = Sampler(seed=3)(logits[[2]], [req(params, seed=7)])
    assert out[2] == alone[0]
    # the unseeded rows are one multinomial over their rows from the sampler's seed
    want = torch.multinomial(logits[[0, 3, 4]].softmax(-1), 1, generator=torch.Generator().manual_seed(3))
    assert [out[0], out[3], out[4]] == want[:, 0].tolist()
    assert all(0 <= t < V for t in out)
