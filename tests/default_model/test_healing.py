"""Token healing on the shipped model: prompts that stop mid-token (half a name, trailing
indentation) are healed, the output gives the removed text back first, greedy output equals
transformers' greedy decoding of the shortened prompt with each step limited to the tokens that
continue the removed text (computed here), and the client's text continues its prompt."""
from __future__ import annotations

import pytest
import torch

from pdkv.engine import SamplingParams
from pdkv.tokenizer import Tokenizer

from _cluster import make_engine, node_config

PROMPTS = ["def read_lines(pa", "import o", "def fibonacci(n):\n    ", "class Stack:\n    def pu",
           "    return sel"]
N = 16


def _masked_greedy(hf, texts, ids: list[int], removed: str, n: int) -> list[int]:
    seq, out, left = list(ids), [], removed
    with torch.no_grad():
        for _ in range(n):
            logits = hf(input_ids=torch.tensor([seq])).logits[0, -1]
            if left:
                allowed = torch.tensor([i for i, t in enumerate(texts)
                                        if t and (t.startswith(left) or left.startswith(t))])
                nxt = int(allowed[logits[allowed].argmax()])
                left = "" if texts[nxt].startswith(left) else left[len(texts[nxt]):]
            else:
                nxt = int(logits.argmax())
            out.append(nxt)
            seq.append(nxt)
    return out


@pytest.fixture(scope="module")
def engine(shipped_dir):
    return make_engine(node_config(shipped_dir, "colocated"))


def test_healed_greedy_equals_the_masked_reference(shipped_dir, hf_model, engine):
    tok = Tokenizer(shipped_dir)
    texts = [tok.decode([i]) for i in range(tok.vocab_size)]
    outs = engine.generate(PROMPTS, SamplingParams(max_tokens=N, temperature=0.0, ignore_eos=True,
                                                   token_healing=True))
    healed = 0
    for p, o in zip(PROMPTS, outs):
        short, h = tok.healer().heal(tok.encode(p))
        assert o.num_prompt_tokens == len(short)
        if h is None:
            continue
        healed += 1
        first = texts[o.output_token_ids[0]]
        assert first.startswith(h.removed_text) or h.removed_text.startswith(first), (p, first)
        assert tok.decode(o.output_token_ids).startswith(h.removed_text)
        assert o.output_token_ids == _masked_greedy(hf_model, texts, short, h.removed_text, N), p
        assert p + o.text == tok.decode(short + o.output_token_ids), p
    assert healed >= 4, healed
