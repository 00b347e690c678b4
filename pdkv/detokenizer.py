"""Incremental detokenization that never emits a broken UTF-8 character, with stop strings.

Decoding one token at a time is wrong for byte-level BPE: a character can span tokens, and
some tokenizers change earlier text when a token follows. As vLLM and TGI do, we decode a short
window ``ids[prefix_offset:]`` and compare it with ``ids[prefix_offset:read_offset]``; the new
text is emitted only when it does not end in U+FFFD (an incomplete character).

Stop strings are checked on the emitted text. While streaming, the last ``len(longest stop) - 1``
characters are held back, so text that later turns out to start a stop string is never sent.
"""

from __future__ import annotations


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_ids: list[int], stop: list[str], skip_special_tokens: bool = True,
                 skip_prefix: str = ""):
        """``skip_prefix``: text the output starts with that is not the client's (token healing
        took it off the prompt and the first tokens give it back): dropped, never emitted, and
        not searched for stop strings."""
        self.tok = tokenizer
        self.skip_prefix = skip_prefix
        self.skip = skip_special_tokens
        self.stop = [s for s in stop if s]
        self.hold = max((len(s) for s in self.stop), default=1) - 1
        # Start the window inside the prompt so the first output token decodes in context.
        self.ids: list[int] = list(prompt_ids[-6:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.text = ""  # all decoded output text so far (stop-truncated when stopped)
        self.sent = 0  # characters of self.text already returned
        self.stopped_on: str | None = None

    def _decode(self, ids):
        return self.tok.decode(ids, skip_special_tokens=self.skip)

    def add(self, token_id: int) -> None:
        """Feeds one generated token; sets ``stopped_on`` when a stop string appears (after which
        further tokens add no text)."""
        if self.stopped_on is not None:
            return
        self.ids.append(token_id)
        prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
        full = self._decode(self.ids[self.prefix_offset:])
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            new = full[len(prefix):]
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
            if self.skip_prefix:
                k = 0  # the output gives skip_prefix back first; drop the part it matches
                while k < min(len(new), len(self.skip_prefix)) and new[k] == self.skip_prefix[k]:
                    k += 1
                # a mismatch (a tokenizer whose decoding is not plain concatenation) ends the
                # skipping: text is never dropped that the prefix does not account for
                self.skip_prefix = self.skip_prefix[k:] if k == min(len(new), len(self.skip_prefix)) else ""
                new = new[k:]
            before = len(self.text)
            self.text += new
            self._check_stop(before)

    def _check_stop(self, before: int) -> None:
        if not self.stop or self.stopped_on is not None:
            return
        # A stop string that ends in the new text may start up to len(stop) - 1 chars earlier.
        start = max(0, before - self.hold)
        best = None
        for s in self.stop:
            i = self.text.find(s, start)
            if i != -1 and (best is None or i < best[0]):
                best = (i, s)
        if best is not None:
            self.text = self.text[:best[0]]
            self.stopped_on = best[1]

    def flush(self, finished: bool) -> str:
        """Returns text not yet returned; holds back a possible stop-string prefix unless finished."""
        end = len(self.text) if finished or self.stopped_on else max(self.sent, len(self.text) - self.hold)
        out = self.text[self.sent:end]
        self.sent = end
        return out
