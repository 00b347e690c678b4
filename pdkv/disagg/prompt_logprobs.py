"""Prompt logprobs (echo + logprobs) of a disaggregated request, computed by the prefill node.

The decode node's PREFILL asks with two fields: ``prompt_logprobs`` (how many top alternatives
per prompt token, as SamplingParams.prompt_logprobs) and ``last_token`` (the prompt's last token,
which the decode node keeps and computes itself: the prefill node's forward over position n-2
scores it, exactly as a colocated forward would). The prefill node's forward records them like a
colocated one (pdkv/engine/runner.py: log_softmax of the raw logits, nothing sampled) and sends

  prefill -> decode  PROMPT_LOGPROBS{req, logprobs: [[token, logprob, [[id, logprob], ...]], ...]}

before its DONE_AT (the control channel is ordered). The decode node starts the request's decode
only once both the KV and this message are there. Both ends bound the message by what was asked:
at most server.max_prompt_logprobs_tokens entries of 1 + N numbers each, one per prompt token
after the first, each naming that prompt token.
"""

from __future__ import annotations

import math

from pdkv.disagg.messages import PROMPT_LOGPROBS, PromptLogprobs  # noqa: F401 - PROMPT_LOGPROBS re-exported
from pdkv.engine.params import MAX_LOGPROBS  # noqa: F401 - the bound PREFILL's prompt_logprobs is checked against
from pdkv.engine.request import TokenLogprob



def encode(req: str, logprobs: list[TokenLogprob]) -> dict:
    """PROMPT_LOGPROBS for ``req`` on the wire (pdkv/disagg/messages.py PromptLogprobs)."""
    return PromptLogprobs(req, tuple(logprobs)).to_wire()


def decode(msg: dict, prompt: list[int], num_top: int) -> list[TokenLogprob]:
    """PROMPT_LOGPROBS' entries for the prompt ``prompt`` asked with ``num_top`` alternatives;
    ValueError names what is wrong (more entries or alternatives than asked for, a token that is
    not the prompt's, a value that is no log-probability)."""
    return check_entries(msg.get("logprobs"), prompt, num_top)


def check_entries(rows, prompt: list[int], num_top: int) -> list[TokenLogprob]:
    """PROMPT_LOGPROBS' ``logprobs`` checked (see decode)."""
    want = len(prompt) - 1
    if not isinstance(rows, list) or len(rows) != want:
        got = len(rows) if isinstance(rows, list) else type(rows).__name__
        raise ValueError(f"PROMPT_LOGPROBS.logprobs must hold {want} entries (one per prompt token after "
                         f"the first), got {got}")
    out = []
    for i, row in enumerate(rows):
        if not isinstance(row, list) or len(row) != 3 or row[0] != prompt[i + 1]:
            raise ValueError(f"PROMPT_LOGPROBS.logprobs[{i}] must be [prompt token {prompt[i + 1]}, "
                             f"logprob, top] ({str(row)[:80]})")
        top = row[2]
        if not isinstance(top, list) or len(top) > num_top:
            raise ValueError(f"PROMPT_LOGPROBS.logprobs[{i}] top must hold at most {num_top} alternatives "
                             f"(as asked), got {len(top) if isinstance(top, list) else top!r}"[:200])
        pairs = []
        for t in top:
            if not (isinstance(t, list) and len(t) == 2 and _token(t[0]) and _lp(t[1])):
                raise ValueError(f"PROMPT_LOGPROBS.logprobs[{i}] top entries must be [token id, logprob]")
            pairs.append((t[0], float(t[1])))
        if not _lp(row[1]):
            raise ValueError(f"PROMPT_LOGPROBS.logprobs[{i}] logprob must be a number <= 0, got {row[1]!r}"[:200])
        out.append(TokenLogprob(row[0], float(row[1]), tuple(pairs)))
    return out


def _token(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 2**31


def _lp(v) -> bool:
    return (isinstance(v, (int, float)) and not isinstance(v, bool)
            and (v == -math.inf or (math.isfinite(v) and v <= 1e-6)))
