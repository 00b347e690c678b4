"""Reasoning parsers (server.reasoning_parser): a model's ``<think>...</think>`` goes to
``reasoning_content``, the rest to ``content``, whole or as streamed text deltas.

``deepseek_r1``: DeepSeek-R1's template opens ``<think>`` in the prompt, so everything up to
``</think>`` is reasoning (an unclosed think: all of it). ``qwen3``: reasoning only when the
output opens with ``<think>`` (Qwen3 with thinking off answers directly).
"""

from __future__ import annotations

START, END = "<think>", "</think>"


def _held(text: str, tag: str) -> int:
    """How many trailing characters of ``text`` could be the start of ``tag``."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


class ReasoningSplitter:
    """Feeds output text, returns (reasoning delta, content delta) each time."""

    def __init__(self, kind: str):
        self.kind = kind
        self.text = ""
        self.sent = 0  # characters of self.text already given out (either side)
        # "start": not yet known (qwen3 waits for the opening tag), "think", "answer"
        self.state = "think" if kind == "deepseek_r1" else "start"
        self.answered = False
        self.opened = False  # deepseek_r1: past a leading <think>, if any

    def feed(self, delta: str, final: bool = False) -> tuple[str, str]:
        self.text += delta
        reasoning, content = "", ""
        while True:
            rest = self.text[self.sent:]
            if self.state == "start":
                stripped = rest.lstrip()
                if stripped.startswith(START):
                    self.sent += len(rest) - len(stripped) + len(START)
                    self.state = "think"
                    continue
                if not final and START.startswith(stripped):
                    return reasoning, content  # could still open a think
                self.state = "answer"
                continue
            if self.state == "think":
                if self.kind == "deepseek_r1" and not self.opened:  # some R1 outputs repeat the tag
                    if rest.startswith(START):
                        self.sent += len(START)
                    elif not final and START.startswith(rest):
                        return reasoning, content
                    self.opened = True
                    continue
                i = rest.find(END)
                if i >= 0:
                    reasoning += rest[:i]
                    self.sent += i + len(END)
                    self.state = "answer"
                    continue
                n = len(rest) if final else len(rest) - _held(rest, END)
                reasoning += rest[:n]
                self.sent += n
                return reasoning, content
            if not self.answered:  # the answer starts at its first non-blank character
                stripped = rest.lstrip()
                self.sent += len(rest) - len(stripped)
                if not stripped:
                    return reasoning, content
                rest, self.answered = stripped, True
            content += rest
            self.sent += len(rest)
            return reasoning, content
