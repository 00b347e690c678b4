"""Shared by tests/default_model: fixed code prompts, transformers greedy decoding, and the
"is this plausible Python" check."""
from __future__ import annotations

import ast

import torch

# What a newcomer would type; none of them is a training file's text. Each ends where a line
# ends in code, at the ":" or the docstring's quotes, not after a newline: the tokenizer merges a
# newline with the next line's indentation, so a prompt ending in a bare "\n" would ask the
# model to continue from a token split it never saw.
CODE_PROMPTS = [
    "def fibonacci(n):",
    'def is_prime(n):\n    """Return True if n is a prime number."""',
    "import os\n\n\ndef read_lines(path):",
    'class Stack:\n    """A last-in, first-out stack."""\n\n    def __init__(self):',
    "def __repr__(self):",
    "for i in range(10):",
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


def complete_lines(prompt: str, completion: str, finished: bool) -> str | None:
    """prompt + completion cut after its last complete line (all of it when the model ended
    the text itself); None when no new line of code came out."""
    text = prompt + completion
    if not finished:
        text = text[:text.rfind("\n") + 1]
    if not text[len(prompt):].strip():
        return None
    return text


def parses(prompt: str, completion: str, finished: bool) -> bool:
    text = complete_lines(prompt, completion, finished)
    if text is None:
        return False
    try:
        ast.parse(text)
    except SyntaxError:
        return False
    return True
