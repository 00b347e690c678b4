"""The structured-output TokenMask on the engine's vocabulary: the xgrammar matcher's masks,
accept and rollback; constrained generation that fails if any row's mask were skipped; the
reasoning gate that leaves ``<think>...</think>`` free and constrains only the answer."""

from __future__ import annotations

import json

import pytest
import torch

from pdkv.engine import SamplingParams
from pdkv.engine.logits import allowed_from_bitmask, bitmask_width
from pdkv.engine.structured import AfterReasoning, GrammarCache
from pdkv.errors import InvalidRequest


@pytest.fixture(scope="module")
def cache(base_engine):
    return GrammarCache(base_engine.tokenizer, base_engine.vocab_size, max_entries=2)


def _allowed(mask, V) -> set[int]:
    bm = torch.zeros(1, bitmask_width(V), dtype=torch.int32)
    mask.fill(bm, 0)
    return set(allowed_from_bitmask(bm, V)[0].nonzero().flatten().tolist())


def test_matcher_masks_accepts_and_rolls_back(base_engine, cache):
    tok, V = base_engine.tokenizer, base_engine.vocab_size
    m = cache.get("regex", "ab[0-9]+").new_mask()
    first = _allowed(m, V)
    assert first and all(tok.decode([t]).startswith("a") or tok.decode([t]) == "ab"[:len(tok.decode([t]))]
                         for t in first)
    a = tok.encode("a", add_special_tokens=False)[0]
    z = tok.encode("z", add_special_tokens=False)[0]
    assert not m.accept(z) and m.accept(a)
    after = _allowed(m, V)
    m.rollback(1)
    assert _allowed(m, V) == first and after != first
    m.close()
    assert cache.num_live_masks == 0


def test_lru_keeps_the_latest_and_bad_input_names_the_field(cache):
    a = cache.get("regex", "x+")
    cache.get("regex", "y+")
    cache.get("regex", "z+")
    assert cache.get("regex", "z+") is cache.get("regex", "z+") and cache.get("regex", "x+") is not a
    with pytest.raises(InvalidRequest, match="guided_regex: cannot be compiled"):
        cache.get("regex", "((", "guided_regex")
    with pytest.raises(InvalidRequest, match="at most"):
        cache.get("json", "x" * 70000, "response_format")


def test_constrained_generation_follows_the_grammar_with_every_seed(base_engine, cache):
    c = cache.get("grammar", 'root ::= "<" [a-c]+ ">" [0-9]')
    outs = base_engine.generate([[5, 6, 7]] * 6, [SamplingParams(max_tokens=40, seed=s, constraint=c)
                                                  for s in range(6)])
    for o in outs:
        assert o.finish_reason == "stop" and o.text[0] == "<" and o.text[-2] == ">" and o.text[-1].isdigit(), o.text
    assert cache.num_live_masks == 0


def test_reasoning_gate_constrains_the_answer_only(base_engine, cache):
    tok, V = base_engine.tokenizer, base_engine.vocab_size
    start, end = tok.encode("<think>", add_special_tokens=False), tok.encode("</think>", add_special_tokens=False)
    gated = AfterReasoning(cache.get("json_object", ""), start, end)
    m = gated.new_mask([1, 2, 3])
    assert len(_allowed(m, V)) == V  # thinking: anything goes
    for t in tok.encode("hmm, an object</think>", add_special_tokens=False):
        assert m.accept(t)
    brace = _allowed(m, V)
    assert brace and all(tok.decode([t]).lstrip().startswith("{") for t in brace)
    m.rollback(1)
    assert len(_allowed(m, V)) == V  # the end of the reasoning undone
    m.close()
    closed = gated.new_mask(start + tok.encode("\n\n", add_special_tokens=False) + end)  # the template closed it
    assert _allowed(closed, V) == brace
    closed.close()


class OnlyTokens:
    """A test stand-in TokenMask (as token healing's first-token restriction would be): the
    given ids for its first token, anything after."""

    def __init__(self, ids):
        self.ids, self.n = set(ids), 0

    def fill(self, bitmask, row):
        if self.n:
            bitmask[row] = -1
            return
        bitmask[row] = 0
        for t in self.ids:
            bitmask[row, t // 32] |= torch.tensor(1 << (t % 32), dtype=torch.int64).to(torch.int32)

    def accept(self, t):
        if self.n == 0 and t not in self.ids:
            return False
        self.n += 1
        return True

    def rollback(self, k):
        self.n -= k

    def close(self):
        pass


def test_two_masks_allow_what_both_allow(base_engine, cache):
    from pdkv.engine.logits import join_masks

    tok, V = base_engine.tokenizer, base_engine.vocab_size
    grammar = cache.get("regex", "[a-z]+").new_mask()
    letters = _allowed(grammar, V)
    some = sorted(letters)[:3] + [t for t in range(V) if t not in letters][:3]
    both = join_masks(join_masks(None, grammar), OnlyTokens(some))
    assert _allowed(both, V) == set(some) & letters and len(set(some) & letters) == 3
    outside = next(t for t in some if t not in letters)
    assert not both.accept(outside) and both.accept(sorted(letters)[0])
    assert _allowed(both, V) == _allowed(grammar, V)  # the first token's restriction is done
    both.rollback(1)
    assert _allowed(both, V) == set(some) & letters
    both.close()


def test_the_device_path_equals_the_cpu_kernel_and_skips_rows_that_allow_all():
    """apply_bitmask_torch is what a GPU runs (torch ops on the logits' device); on the CPU it is
    the stand-in and must equal xgrammar's kernel bit for bit. A row whose mask allows
    everything is left out of the bitmask's rows."""
    from types import SimpleNamespace

    from pdkv.engine.logits import apply_bitmask, apply_bitmask_torch, fill_masks

    g = torch.Generator().manual_seed(0)
    V = 1000  # not a multiple of 32: the last word's spare bits are ignored
    bm = torch.randint(-2**31, 2**31 - 1, (6, bitmask_width(V)), dtype=torch.int32, generator=g)
    logits = torch.randn(6, V, generator=g)
    for rows in ([0, 1, 2, 3, 4, 5], [1, 4]):
        a, b = logits.clone(), logits.clone()
        apply_bitmask(a, bm, rows)  # xgrammar's kernel on a CPU
        apply_bitmask_torch(b, bm, rows)
        assert torch.equal(a, b) and torch.isinf(b[rows]).any() and torch.equal(b[0], logits[0]) == (0 not in rows)
    thinking = OnlyTokens([1, 2])
    thinking.allows_all = True
    some = OnlyTokens([1, 2])
    reqs = [SimpleNamespace(mask=m, params=None) for m in (thinking, None, some)]
    bitmask, rows = fill_masks([(r, []) for r in reqs], V)
    assert rows == [2] and bool((bitmask[:2] == -1).all())
    assert set(allowed_from_bitmask(bitmask[2:], V)[0].nonzero().flatten().tolist()) == {1, 2}


def test_masks_filled_during_the_forward_give_the_same_tokens(base_engine, cache):
    from types import SimpleNamespace

    from pdkv.engine import logits as proc

    c = cache.get("grammar", 'root ::= "<" [a-c]+ ">" [0-9]')
    outs = {}
    try:
        for overlap in (True, False, None):
            base_engine.runner.overlap_masks = overlap
            outs[overlap] = [o.output_token_ids for o in base_engine.generate(
                [[5, 6, 7]] * 4, [SamplingParams(max_tokens=30, seed=s, constraint=c) for s in range(4)])]
    finally:
        base_engine.runner.overlap_masks = None
    assert outs[True] == outs[False] == outs[None] and cache.num_live_masks == 0
    # below OVERLAP_MIN_CPU_WORK a CPU fills after the forward; a fill's error reaches the step
    m = SimpleNamespace(mask=OnlyTokens([1]), params=None)
    assert proc.start_masks([(m, [])], 100, "cpu") is None
    assert proc.start_masks([(SimpleNamespace(mask=None), [])], 100, "cpu", True) is None

    class Broken(OnlyTokens):
        def fill(self, bitmask, row):
            raise RuntimeError("matcher gone")

    pending = proc.start_masks([(SimpleNamespace(mask=Broken([1])), [])], 100, "cpu", True)
    with pytest.raises(RuntimeError, match="matcher gone"):
        pending.result()
    pending = proc.start_masks([(SimpleNamespace(mask=Broken([1])), [])], 100, "cpu", True)
    pending.wait()  # a failed step waits for the fill without raising its error again
