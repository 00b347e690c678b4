"""Shared by tests/default_model: fixed code prompts, transformers greedy decoding, and the
"is this plausible Python" check."""
from __future__ import annotations

import torch

from default_model_eval import complete_lines, parses  # noqa: F401 - the one scoring rule, in tools/

# Fixed code prompts in the stdlib's style, each ending where its line ends; test_plausible also
# asks for them after a newline, which the tokenizer keeps apart from the next line's
# indentation. (The wider 16 prompts of tools/default_model_prompts.json are test_eval_prompts':
# it is a tiny model, best at a top-level function's docstring.)
CODE_PROMPTS = [
    "def fibonacci(n):",
    "def close(self):",
    "def read_lines(path):",
    "def main():",
    "def get(self, key, default=None):",
    "with open(path) as f:",
    "import os\n\n\ndef walk(top):",
    "def __repr__(self):",
]


def hf_greedy(model, ids: list[int], n: int, eos: set[int] = frozenset()) -> list[int]:
    """``n`` greedy tokens from transformers' logits (full forward each step: no cache API in
    the way), stopping after a token in ``eos``."""
    seq, out = list(ids), []
    with torch.no_grad():
        for _ in range(n):
            nxt = int(model(input_ids=torch.tensor([seq])).logits[0, -1].argmax())
            out.append(nxt)
            seq.append(nxt)
            if nxt in eos:
                break
    return out


def hf_generate(model, tokenizer, prompt: str, n: int) -> tuple[str, bool]:
    """transformers' own greedy ``generate`` (KV cache, stops at EOS): (completion text, whether
    the model ended it)."""
    eos = [tokenizer.convert_tokens_to_ids(t) for t in ("<|im_end|>", "<|endoftext|>")]
    ids = torch.tensor([tokenizer(prompt)["input_ids"]])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                             eos_token_id=eos, pad_token_id=eos[1])[0, ids.shape[1]:].tolist()
    return tokenizer.decode(out, skip_special_tokens=True), bool(out) and out[-1] in eos
