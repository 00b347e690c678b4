"""Structured output: grammars compiled for the engine's vocabulary with xgrammar, and the
per-request matcher that is a request's TokenMask (pdkv/engine/logits.py).

xgrammar (the library vLLM and SGLang use) compiles a JSON schema, a regex, an EBNF grammar or
a list of choices once into a ``CompiledGrammar`` (immutable, shared by every request with the
same constraint: ``GrammarCache`` keeps the most recent ones); each request gets its own
``GrammarMatcher`` over it, which fills the bitmask of the tokens allowed next, accepts the
tokens sampled and rolls back accepted drafts (speculative decoding). xgrammar is imported only
when a grammar is first compiled, so nothing else needs it installed.

Compiling can take long (a large schema: seconds): callers run ``GrammarCache.get`` off the
event loop (server/structured.py bounds its time); the text of a constraint is bounded here.
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict

import torch

from pdkv.errors import InvalidRequest

MAX_CONSTRAINT_CHARS = 64 * 1024  # a schema / regex / grammar longer than this is refused
_XGR_PREFIX = re.compile(r"^\[[^\]]*\]\s*\S+:\d+:\s*")  # "[time] file.cc:line: " of xgrammar's errors


def _vocab_type(tokenizer) -> int:
    """xgrammar's name for how token strings encode bytes, from tokenizer.json's decoder."""
    import xgrammar as xgr  # noqa: PLC0415

    return {"ByteLevel": xgr.VocabType.BYTE_LEVEL, "ByteFallback": xgr.VocabType.BYTE_FALLBACK}.get(
        getattr(tokenizer, "byte_encoding", ""), xgr.VocabType.RAW)


class Constraint:
    """One compiled grammar; ``new_mask()`` gives a request its matcher (SamplingParams.constraint)."""

    def __init__(self, compiled, stop_token_ids: list[int], counter: GrammarCache):
        self.compiled, self.stop_token_ids, self.counter = compiled, stop_token_ids, counter

    def new_mask(self, prompt_token_ids=()) -> GrammarMask:
        return GrammarMask(self, self.counter)


class AfterReasoning:
    """A constraint for the answer only: its masks allow any token until the reasoning has ended
    (``end_ids``, the tokens of ``</think>``, in the output, or in the prompt after its last
    ``start_ids``: a template that closed the think itself), then are ``inner``'s."""

    def __init__(self, inner, start_ids: list[int], end_ids: list[int]):
        self.inner, self.start_ids, self.end_ids = inner, list(start_ids), list(end_ids)

    def new_mask(self, prompt_token_ids=()) -> ReasoningGate:
        ids = list(prompt_token_ids)
        last_start = max((i for i in range(len(ids)) if ids[i:i + len(self.start_ids)] == self.start_ids),
                         default=-1)
        tail = ids[last_start + 1:] if last_start >= 0 else []
        ended = last_start >= 0 and any(tail[i:i + len(self.end_ids)] == self.end_ids for i in range(len(tail)))
        return ReasoningGate(self.inner.new_mask(), self.end_ids, ended)


class ReasoningGate:
    """The TokenMask of AfterReasoning."""

    def __init__(self, inner, end_ids: list[int], opened: bool):
        self.inner, self.end_ids = inner, end_ids
        self.tokens: list[int] = []  # accepted so far (what rollback undoes)
        self.opened_at = 0 if opened else None  # len(tokens) when the answer began

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        if self.opened_at is None:
            bitmask[row] = -1
        else:
            self.inner.fill(bitmask, row)

    def accept(self, token_id: int) -> bool:
        if self.opened_at is not None and not self.inner.accept(token_id):
            return False
        self.tokens.append(token_id)
        if self.opened_at is None and self.tokens[-len(self.end_ids):] == self.end_ids:
            self.opened_at = len(self.tokens)
        return True

    def rollback(self, num_tokens: int) -> None:
        for _ in range(num_tokens):
            if self.opened_at is not None and len(self.tokens) > self.opened_at:
                self.inner.rollback(1)
            elif self.opened_at is not None and self.opened_at == len(self.tokens) and self.opened_at > 0:
                self.opened_at = None  # the token that ended the reasoning is undone
            self.tokens.pop()

    def close(self) -> None:
        self.inner.close()

    @property
    def terminated(self) -> bool:
        return self.opened_at is not None and getattr(self.inner, "terminated", False)

    @property
    def allows_all(self) -> bool:
        return self.opened_at is None


class GrammarMask:
    """A request's xgrammar matcher as a TokenMask."""

    def __init__(self, constraint: Constraint, counter: GrammarCache):
        import xgrammar as xgr  # noqa: PLC0415

        self.matcher = xgr.GrammarMatcher(constraint.compiled, override_stop_tokens=constraint.stop_token_ids)
        self.counter = counter
        counter.opened(1)

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        self.matcher.fill_next_token_bitmask(bitmask, row)

    def accept(self, token_id: int) -> bool:
        if self.matcher.is_terminated():
            return False
        return bool(self.matcher.accept_token(token_id))

    def rollback(self, num_tokens: int) -> None:
        self.matcher.rollback(num_tokens)

    @property
    def completed(self) -> bool:
        return self.matcher.is_completed()

    @property
    def terminated(self) -> bool:
        """It accepted its stop token: no token may follow (the request ends, ignore_eos or not)."""
        return self.matcher.is_terminated()

    def close(self) -> None:
        if self.matcher is not None:
            self.matcher = None
            self.counter.opened(-1)


class GrammarCache:
    """Compiles constraints for one vocabulary and keeps the last ``max_entries`` compiled."""

    def __init__(self, tokenizer, vocab_size: int, max_entries: int = 64, num_threads: int = 1,
                 encoded_vocab: list[str] | None = None):
        """``tokenizer``: a pdkv.tokenizer.Tokenizer (its token strings, how they encode bytes,
        its EOS ids); ``vocab_size``: the logits' width. ``encoded_vocab``: token strings
        instead of the tokenizer's (byte-level; benchmarks of large vocabularies)."""
        import xgrammar as xgr  # noqa: PLC0415

        if encoded_vocab is None:
            vocab = [tokenizer.id_to_token(i) or "" for i in range(tokenizer.vocab_size)]
            kind = _vocab_type(tokenizer)
        else:
            vocab, kind = encoded_vocab, xgr.VocabType.BYTE_LEVEL
        self.stop_token_ids = sorted(tokenizer.eos_token_ids)
        info = xgr.TokenizerInfo(vocab, kind, vocab_size=vocab_size, stop_token_ids=self.stop_token_ids)
        # NOTE: xgrammar's own cache is off: this LRU bounds how many compiled grammars stay.
        self.compiler = xgr.GrammarCompiler(info, max_threads=num_threads, cache_enabled=False)
        self.max_entries = max_entries
        self._lru: OrderedDict[tuple[str, str], Constraint] = OrderedDict()
        self._lock = threading.Lock()
        self.num_compiled = 0
        self.num_live_masks = 0

    def opened(self, n: int) -> None:
        with self._lock:
            self.num_live_masks += n

    def get(self, kind: str, value: str, field: str = "response_format") -> Constraint:
        """The compiled ``kind`` ("json", "json_object", "regex", "choice", "grammar") of
        ``value``; InvalidRequest naming ``field`` when it cannot be compiled."""
        if len(value) > MAX_CONSTRAINT_CHARS:
            raise InvalidRequest(f"{field}: {len(value)} characters; at most {MAX_CONSTRAINT_CHARS} are compiled")
        key = (kind, value)
        with self._lock:
            hit = self._lru.get(key)
            if hit is not None:
                self._lru.move_to_end(key)
                return hit
        try:
            compiled = self._compile(kind, value)
        except InvalidRequest:
            raise
        except Exception as e:  # noqa: BLE001 - xgrammar raises RuntimeError / ValueError for bad input
            why = _XGR_PREFIX.sub("", str(e).splitlines()[0] if str(e) else type(e).__name__)[:300]
            raise InvalidRequest(f"{field}: cannot be compiled into a grammar ({why})") from None
        c = Constraint(compiled, self.stop_token_ids, self)
        with self._lock:
            self.num_compiled += 1
            self._lru[key] = c
            while len(self._lru) > self.max_entries:
                self._lru.popitem(last=False)
        return c

    def _compile(self, kind: str, value: str):
        if kind == "json":
            return self.compiler.compile_json_schema(value, any_whitespace=False)
        if kind == "json_object":  # OpenAI's json_object is an object (xgrammar's builtin: any value)
            return self.compiler.compile_json_schema('{"type": "object"}', any_whitespace=False)
        if kind == "regex":
            return self.compiler.compile_regex(value)
        if kind == "grammar":
            return self.compiler.compile_grammar(value)
        if kind == "choice":
            choices = json.loads(value)
            return self.compiler.compile_grammar("root ::= " + " | ".join(json.dumps(c) for c in choices))
        raise InvalidRequest(f"unknown constraint kind {kind!r}")
