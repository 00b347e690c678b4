"""A request's state machine and the output records the engine returns.

  WAITING ──schedule──► RUNNING ──eos/stop/length──► FINISHED
     ▲                    │
     └──── preempted ─────┘ (pages freed; prompt + outputs recomputed later)
  WAITING_FOR_REMOTE_KV ──remote KV landed──► RUNNING       (disaggregated decode side)
  any state ──abort──► ABORTED

Prefix caching (pdkv/kv/prefix_cache.py): a request leaving WAITING with no pages first takes the
longest chain of cached full pages (``num_computed_tokens`` starts after them), and each full page
it completes is published; a preempted request finds its own pages again that way.

NOTE: every exit (finish, abort, preemption) frees the request's pages exactly once: the
scheduler empties ``pages`` in the same call that frees them.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from pdkv.engine.params import SamplingParams


class RequestStatus(enum.Enum):
    PENDING = "pending"  # submitted, waiting for admission (its pages / the connector's resources)
    WAITING = "waiting"
    WAITING_FOR_REMOTE_KV = "waiting_for_remote_kv"
    RUNNING = "running"
    FINISHED = "finished"
    ABORTED = "aborted"

    @property
    def is_done(self) -> bool:
        return self in (RequestStatus.FINISHED, RequestStatus.ABORTED)


@dataclass(frozen=True)
class TokenLogprob:
    """One token's log-probability and the ``top`` alternatives ((token id, logprob), best first)."""

    token_id: int
    logprob: float
    top: tuple = ()


@dataclass
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    detok: object  # pdkv.detokenizer.IncrementalDetokenizer
    arrival: float = field(default_factory=time.perf_counter)  # when it reached the node
    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    pages: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0  # tokens whose K/V are in the cache
    finish_reason: str | None = None
    generator: object = None  # torch.Generator when params.seed is set
    num_preemptions: int = 0
    num_returned: int = 0  # output tokens already reported in a RequestOutput
    prefill_only: bool = False  # disaggregated prefill: never sampled, pages held after the last chunk
    num_external_tokens: int = 0  # prompt tokens whose KV arrives from outside (disaggregated decode)
    spec_token_ids: list[int] = field(default_factory=list)  # drafts to verify in its next decode step
    # Leading tokens whose KV the request took from the local prefix cache. Before admission: what
    # the cache holds for it now (a peek the KV connector reads); a local request looks again
    # when it is scheduled.
    num_cached_tokens: int = 0
    reuse_cache: bool = True  # take cached pages when scheduled (Admission.reuse_cached)
    page_hashes: list[bytes] = field(default_factory=list)  # chained hashes of its full pages, memoized
    num_published_pages: int = 0  # leading pages already offered to the prefix cache
    mask: object = None  # a pdkv.engine.logits.TokenMask: the tokens it may take next (None: any)
    logprobs: list = field(default_factory=list)  # a TokenLogprob per output token (params.logprobs)
    # a TokenLogprob per prompt token after the first (params.prompt_logprobs), filled by the
    # forward passes over the prompt, or by the prefill node (disaggregated)
    prompt_logprobs: list = field(default_factory=list)
    # the token after the prompt when it is known but not part of it (a prefill node's request:
    # the decode node's held-back last prompt token): the last prompt row scores it too
    prompt_next_token: int | None = None
    # pdkv.tokenizer_healing.HealingState when token healing took prompt tokens off: the text
    # the output starts with (not the client's); it is also one of the TokenMasks of ``mask``
    healing: object = None
    priority: int = 0  # scheduler.policy priority: lower runs first (vLLM's request field)
    seq: int = 0  # submission order on this node (the scheduler's tie-break after arrival)

    @property
    def resumed_ids(self) -> list[int]:
        """The prompt's last tokens that are output of the node the stream began on (a resume)."""
        r = self.params.resume
        return self.prompt_token_ids[r.prompt_len:] if r is not None else []

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    def token_ids(self, start: int, end: int) -> list[int]:
        """Tokens [start, end) of prompt + output."""
        n = len(self.prompt_token_ids)
        if end <= n:
            return self.prompt_token_ids[start:end]
        return (self.prompt_token_ids + self.output_token_ids)[start:end]

    def append(self, tokens: list[int], eos_token_ids, max_model_len: int,
               logprobs: list | None = None) -> tuple[list[int], str | None]:
        """Appends one step's sampled ``tokens`` (several when drafts were accepted) in order, up
        to the first that ends the request (EOS, a stop token or string, max_tokens, the context):
        the rest are dropped, as if they had been decoded one by one. Returns the tokens kept and
        the finish reason they reached ("stop", "length", or None: the request goes on).
        ``logprobs``: a TokenLogprob per token (kept for the tokens kept); the request's
        ``mask`` advances past each kept token."""
        p = self.params
        new, reason = [], None
        for i, token in enumerate(tokens):
            if logprobs is not None:
                self.logprobs.append(logprobs[i])
            if self.mask is not None:
                self.mask.accept(token)
            self.output_token_ids.append(token)
            ends = ((token in eos_token_ids and not p.ignore_eos) or token in p.stop_token_ids
                    or (self.mask is not None and getattr(self.mask, "terminated", False)))
            if not (ends and not p.skip_special_tokens):  # an ending token's text is no output
                self.detok.add(token)
            new.append(token)
            if ends or self.detok.stopped_on is not None:
                reason = "stop"
            elif len(self.output_token_ids) >= p.max_tokens or self.num_tokens >= max_model_len:
                reason = "length"
            if reason is not None:
                break
        return new, reason


@dataclass
class RequestOutput:
    request_id: str
    new_token_ids: list[int]
    new_text: str
    finished: bool
    finish_reason: str | None  # "stop" | "length" | "abort" | "error" | None
    num_prompt_tokens: int
    num_output_tokens: int
    output_token_ids: list[int]  # all output tokens so far
    text: str = ""  # all output text so far (stop-truncated)
    new_logprobs: list = field(default_factory=list)  # a TokenLogprob per new token (if asked)
    prompt_logprobs: list | None = None  # a TokenLogprob per prompt token after the first (if asked)

    @classmethod
    def delta(cls, req: Request, new_ids: list[int]) -> RequestOutput:
        """What ``req`` adds now: ``new_ids`` and the text they complete (once it is done, the
        text the detokenizer held back too)."""
        done = req.status.is_done
        lps = req.logprobs[len(req.logprobs) - len(new_ids):] if req.params.logprobs is not None and new_ids else []
        prompt_lps = req.prompt_logprobs if req.params.prompt_logprobs is not None else None
        return cls(req.request_id, new_ids, req.detok.flush(done), done, req.finish_reason, req.num_prompt_tokens,
                   len(req.output_token_ids), list(req.output_token_ids), req.detok.text, lps, prompt_lps)

    @classmethod
    def prefilled(cls, req: Request) -> RequestOutput:
        """The end of a prefill-only request (no tokens, no text)."""
        prompt_lps = list(req.prompt_logprobs) if req.params.prompt_logprobs is not None else None
        return cls(req.request_id, [], "", True, req.finish_reason, req.num_prompt_tokens, 0, [], "",
                   prompt_logprobs=prompt_lps)

    def whole(self, logprobs: list | None = None) -> RequestOutput:
        """This final output as one delta holding everything (what ``LLMEngine.generate`` returns);
        ``logprobs``: the request's, gathered from its deltas."""
        return RequestOutput(self.request_id, list(self.output_token_ids), self.text, True, self.finish_reason,
                             self.num_prompt_tokens, self.num_output_tokens, self.output_token_ids, self.text,
                             list(logprobs or []), self.prompt_logprobs)
