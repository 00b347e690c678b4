"""Token healing in the engine, on a random tiny model whose vocabulary has the newline boundary
(``Ċ`` and ``ĊĠĠĠ``, the ``boundary_model_dir`` fixture): which prompt tokens come off, that the
output gives their text back first, that greedy output equals a reference computed here with
transformers (the shortened prompt, each step's argmax over the tokens that continue the removed
text), the returned text, off by default, speculative decoding (ngram) giving the same tokens,
and the verifier refusing drafts outside the mask."""
from __future__ import annotations

import pytest
import torch

from pdkv.config import KVCacheConfig, ModelConfig, SchedulerConfig, SpeculativeConfig
from pdkv.engine import LLMEngine, SamplingParams
from pdkv.engine.logits import allowed_from_bitmask, bitmask_width, process
from pdkv.engine.request import Request
from pdkv.engine.spec.verify import Verifier
from pdkv.tokenizer import Tokenizer
from pdkv.tokenizer_healing import MAX_CHARS, MAX_TOKENS, HealingState

PROMPTS = ["def add(a, b):\n", "class Counter:\n    def increment(self):\n", "def f(x):\n    ret",
           "x = 1 ", "def scale(values, factor):\n    "]
N = 12


@pytest.fixture(scope="module")
def tok(boundary_model_dir):
    return Tokenizer(boundary_model_dir)


@pytest.fixture(scope="module")
def texts(tok):
    """Each id's text, decoded on its own (the test's own view of the vocabulary); "" for the
    special tokens."""
    return [tok.decode([i]) for i in range(tok.vocab_size)]


@pytest.fixture(scope="module")
def hf(boundary_model_dir):
    from transformers import LlamaForCausalLM

    torch.set_num_threads(1)
    return LlamaForCausalLM.from_pretrained(boundary_model_dir, dtype=torch.float32).eval()


def _engine(path, spec=None):
    return LLMEngine(ModelConfig(path=str(path)), KVCacheConfig(page_size=4, num_pages=128),
                     SchedulerConfig(max_num_batched_tokens=64, chunk_size=8), num_threads=1,
                     speculative=spec)


def _allowed(texts, left: str) -> set[int]:
    """What may follow while ``left`` is still to be given back (brute force over the vocabulary)."""
    return {i for i, t in enumerate(texts) if t and (t.startswith(left) or left.startswith(t))}


def _reference(hf, texts, ids: list[int], removed: str, n: int) -> list[int]:
    """Greedy tokens of transformers from ``ids`` (the shortened prompt), each step limited to the
    tokens that continue ``removed`` until it is given back."""
    seq, out, left = list(ids), [], removed
    with torch.no_grad():
        for _ in range(n):
            logits = hf(input_ids=torch.tensor([seq])).logits[0, -1]
            if left:
                allowed = torch.tensor(sorted(_allowed(texts, left)))
                nxt = int(allowed[logits[allowed].argmax()])
                t = texts[nxt]
                left = "" if t.startswith(left) else left[len(t):]
            else:
                nxt = int(logits.argmax())
            out.append(nxt)
            seq.append(nxt)
    return out


def test_which_tokens_come_off(tok, texts):
    index = tok.healer()
    ids = tok.encode("def add(a, b):\n")
    assert tok.id_to_token(ids[-1]) == "Ċ"
    short, h = index.heal(ids)
    assert short == ids[:-1] and h.num_removed == 1 and h.removed_text == "\n"
    allowed = set(index.allowed(h.removed).tolist())
    assert tok.encode("\n   ", add_special_tokens=False) == [tok._tok.token_to_id("ĊĠĠĠ")]
    assert tok._tok.token_to_id("ĊĠĠĠ") in allowed and ids[-1] in allowed
    assert allowed == _allowed(texts, "\n")  # the sorted-bytes index agrees with brute force
    # half a word: two tokens whose joint text a longer token starts with
    ids = tok.encode("def f(x):\n    ret")
    short, h = index.heal(ids)
    assert h.num_removed == 2 and h.removed_text == " ret" and short == ids[:-2]
    assert set(index.allowed(h.removed).tolist()) == _allowed(texts, " ret")
    # nothing to heal: a prompt ending on a special token, a one-token prompt
    assert index.heal(tok.encode("x<|im_end|>"))[1] is None
    assert index.heal(ids[:1]) == (ids[:1], None)
    for p in PROMPTS:
        short, h = index.heal(tok.encode(p))
        assert h is None or (h.num_removed <= MAX_TOKENS and len(h.removed_text) <= MAX_CHARS
                             and tok.decode(short) + h.removed_text == p)


def test_greedy_with_healing_equals_the_masked_reference(boundary_model_dir, tok, texts, hf):
    eng = _engine(boundary_model_dir)
    outs = eng.generate(PROMPTS, SamplingParams(max_tokens=N, temperature=0.0, ignore_eos=True,
                                                token_healing=True))
    healed = 0
    for p, o in zip(PROMPTS, outs):
        ids = tok.encode(p)
        short, h = tok.healer().heal(ids)
        assert o.num_prompt_tokens == len(short)
        if h is None:
            continue
        healed += 1
        first = texts[o.output_token_ids[0]]
        assert first.startswith(h.removed_text) or h.removed_text.startswith(first)
        assert tok.decode(o.output_token_ids).startswith(h.removed_text)  # given back first
        assert o.output_token_ids == _reference(hf, texts, short, h.removed_text, N)
        # the client's text: its own prompt followed by the returned text is the whole sequence
        # (random weights end on half a character at times, which the detokenizer holds back)
        whole = tok.decode(short + o.output_token_ids).rstrip("\ufffd")
        assert (p + o.text).rstrip("\ufffd") == whole
        given = tok.decode(o.output_token_ids)[len(h.removed_text):]
        assert o.text.rstrip("\ufffd") == given.rstrip("\ufffd")
    assert healed >= 4
    # off by default: the whole prompt is run
    (plain,) = eng.generate([PROMPTS[0]], SamplingParams(max_tokens=N, temperature=0.0, ignore_eos=True))
    assert plain.num_prompt_tokens == len(tok.encode(PROMPTS[0]))
    with pytest.raises(Exception, match="token_healing must be true or false"):
        eng.generate([PROMPTS[0]], SamplingParams(token_healing="yes"))


def test_ngram_speculation_gives_the_same_tokens(boundary_model_dir, tok):
    params = [SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, token_healing=True),
              SamplingParams(max_tokens=24, temperature=0.8, seed=5, token_healing=True)]
    plain = _engine(boundary_model_dir)
    spec = _engine(boundary_model_dir, SpeculativeConfig(method="ngram", num_tokens=3))
    for p in params:
        want = [o.output_token_ids for o in plain.generate(PROMPTS, p)]
        got = spec.generate(PROMPTS, p)
        if p.greedy:  # greedy speculation is token for token plain decoding
            assert [o.output_token_ids for o in got] == want
        for prompt, o in zip(PROMPTS, got):  # sampled too, the output gives the removed text back
            _, h = tok.healer().heal(tok.encode(prompt))
            if h is not None:
                assert tok.decode(o.output_token_ids).startswith(h.removed_text), (prompt, o.output_token_ids)
    assert spec.stats()["spec_num_draft_tokens"] > 0


def test_verifier_refuses_drafts_outside_the_mask(tok):
    """Healing is a TokenMask like a grammar: the rows of a verification are masked by
    pdkv.engine.logits.process (after the drafts before each), the drafts are rolled back."""
    index = tok.healer()
    short, h = index.heal(tok.encode("def add(a, b):\n"))
    allowed = set(index.allowed(h.removed).tolist())
    bad = next(i for i in range(tok.vocab_size) if i not in allowed)
    good = tok._tok.token_to_id("ĊĠĠĠ")
    logits = torch.zeros(3, tok.vocab_size)
    logits[0, bad] = 10.0  # the target itself prefers a token healing does not allow
    logits[0, good] = 5.0
    logits[1, bad] = 10.0  # after good, healing is done: row 1 is not masked
    ver = Verifier(torch.Generator().manual_seed(0))
    for temperature in (0.0, 1.0):
        heal = HealingState(index, h)
        req = Request("r", short, SamplingParams(temperature=temperature), detok=None, healing=heal, mask=heal)

        def verify(drafts):
            out = ver(process(logits, [(req, drafts)]), req, drafts)
            assert heal.left == h.removed  # the drafts were accepted and rolled back
            return out

        for _ in range(20):
            out = verify([bad, bad])
            assert out[0] in allowed and out[0] != bad, out
        if temperature == 0.0:
            assert verify([bad, bad]) == [good]
            # an allowed draft is kept, and once the text is given back nothing is masked
            assert verify([good, bad]) == [good, bad, 0]


def test_healing_mask_accepts_rolls_back_and_fills_what_allowed_gives(tok):
    index = tok.healer()
    _, h = index.heal(tok.encode("def add(a, b):\n"))
    heal, V = HealingState(index, h), tok.vocab_size
    bm = torch.zeros(1, bitmask_width(V), dtype=torch.int32)
    heal.fill(bm, 0)
    filled = set(allowed_from_bitmask(bm, V)[0].nonzero().flatten().tolist())
    assert filled == set(index.allowed(h.removed).tolist())
    good, bad = tok._tok.token_to_id("ĊĠĠĠ"), tok._tok.token_to_id("x")
    assert not heal.accept(bad) and heal.left == h.removed  # refused: unchanged
    assert heal.accept(good) and heal.left is None and heal.accept(bad) and heal.accept(bad)
    heal.fill(bm, 0)
    assert bool((bm == -1).all())  # done: everything allowed (the sampler skips the row)
    heal.rollback(2)
    assert heal.left is None
    heal.rollback(1)
    assert heal.left == h.removed
