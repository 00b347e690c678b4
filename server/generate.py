"""From a parsed request to a stream of engine outputs: tokenize, validate, submit, abort.

Everything that can be refused is refused here, before the first ``submit``: the prompt is
tokenized (chat: the model's chat template first), every choice's ``SamplingParams`` is built
and checked with ``engine.validate_request`` — so a 400 never leaves work in the engine. After
submission, ``Generation.outputs()`` yields ``(choice_index, RequestOutput)``; leaving it in
any way (finished, client gone, handler cancelled) aborts whatever has not finished, which frees
those requests' pages.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import dataclass, field
from typing import AsyncIterator

from pdkv.detokenizer import IncrementalDetokenizer
from pdkv.engine import SamplingParams
from pdkv.engine.params import Resume
from pdkv.errors import InvalidRequest
from pdkv.server.async_engine import AsyncEngine, EngineFailure
from pdkv.server.errors import APIError
from pdkv.server.protocol import GenerateRequest


@dataclass
class Choice:
    index: int
    rid: str
    prompt_index: int
    text: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    num_output_tokens: int = 0
    logprobs: list = field(default_factory=list)  # pdkv.engine.request.TokenLogprob per output token
    prompt_logprobs: list | None = None  # per prompt token after the first (echo + logprobs)


class Generation:
    """The choices of one HTTP request, submitted to the engine together."""

    def __init__(self, aengine: AsyncEngine, req: GenerateRequest, prefix: str, constraint=None,
                 max_prompt_logprobs_tokens: int = 2048, keep_special_tokens: bool = False,
                 token_healing: str | bool = "off"):
        """``constraint``: the compiled output constraint (server/structured.py), or None;
        ``keep_special_tokens``: the text keeps special tokens (a tool parser reads its own);
        ``token_healing``: server.token_healing, for a request that does not say."""
        self.keep_special_tokens = keep_special_tokens
        self.aengine = aengine
        self.req = req
        self.constraint = constraint
        self.max_prompt_logprobs_tokens = max_prompt_logprobs_tokens
        self.token_healing = token_healing
        self.id = f"{prefix}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.arrival = time.perf_counter()
        self.prompt_token_ids: list[list[int]] = []
        # prompt index -> the tokens the engine runs it with (fewer once token healing took
        # some off): what usage and the returned prompt_token_ids count, as vLLM counts them
        self.engine_prompt_tokens: dict[int, int] = {}
        self.choices: list[Choice] = []
        self._params: list[SamplingParams] = []
        self._sink: asyncio.Queue = asyncio.Queue()
        self._open: set[str] = set()

    # ---- before submission: everything that can fail with a 400 ---------------------------
    def prepare(self) -> None:
        engine, req = self.aengine.engine, self.req
        tok = engine.tokenizer
        if req.chat:
            extra = {"tools": [dict(t) for t in req.tools.tools]} if req.tools is not None else {}
            try:
                text = tok.apply_chat_template(req.messages, add_generation_prompt=True, **extra)
            except Exception as e:  # noqa: BLE001 - a template that refuses these messages
                raise APIError(f"the model's chat template cannot render these messages: {e}", 400,
                               param="messages") from None
            # The template already wrote any BOS token; encode must not add a second one.
            self.prompt_token_ids = [_encode(tok, text, add_special_tokens=False)]
        else:
            self.prompt_token_ids = [_encode(tok, p, add_special_tokens=True) if isinstance(p, str) else p
                                     for p in req.prompts]
        self.resume: Resume | None = None  # a migrated stream's state (the engine replays it)
        self.resume_replay = ""  # the output text the client has of a resumed stream
        if req.resume_token_ids:
            resume = list(req.resume_token_ids)
            if req.max_tokens is not None and req.max_tokens <= len(resume):
                raise APIError(f"pdkv_resume: {len(resume)} tokens already produced, max_tokens is "
                               f"{req.max_tokens}: nothing is left to generate", 400, param="pdkv_resume")
            # the earlier tokens join the prompt: their KV is recomputed here, the next token is
            # sampled from the same context; the engine replays them into the request's state
            # (SamplingParams.resume: detokenizer, seeded generator, grammar, penalties), so the
            # stream goes on as an undisturbed run would, from the text_chars the client has
            prompt, skip = self.prompt_token_ids[0], ""
            eng = list(req.resume_prompt_token_ids or ())
            if eng and prompt[:len(eng)] == eng and len(eng) < len(prompt):
                # the first node healed the prompt (ran it without its last tokens, and dropped
                # their text from the output the tokens gave back): resume from the same prompt
                healed = IncrementalDetokenizer(tok, eng, [], not self.keep_special_tokens)
                for t in prompt[len(eng):]:
                    healed.add(t)
                prompt, skip = eng, healed.text
            if self.constraint is not None:  # the tokens must follow the grammar the matcher replays
                mask = self.constraint.new_mask(prompt)
                try:
                    if not all(mask.accept(t) for t in resume):
                        raise APIError("pdkv_resume: the token ids do not follow the request's structured "
                                       "output", 400, param="pdkv_resume")
                finally:
                    mask.close()
            self.resume = Resume(len(prompt), req.resume_text_chars, skip)
            # the text of the resumed tokens the client has: a chat stream's output parser
            # (reasoning) is fed it first, so it is in the state the first node's was
            det = IncrementalDetokenizer(tok, prompt, [], not self.keep_special_tokens, skip_prefix=skip)
            for t in resume:
                det.add(t)
            self.resume_replay = det.text[:req.resume_text_chars]
            self.prompt_token_ids = [prompt + resume]
        bad_words = [w for word in req.bad_words for w in _word_ids(tok, word)]
        prompt_logprobs = req.logprobs if req.echo and req.logprobs is not None else None
        for i, ids in enumerate(self.prompt_token_ids):
            if prompt_logprobs is not None and len(ids) > self.max_prompt_logprobs_tokens:
                raise APIError(f"echo with logprobs: the prompt has {len(ids)} tokens, the limit is "
                               f"{self.max_prompt_logprobs_tokens} (server.max_prompt_logprobs_tokens)",
                               400, param="echo")
            # Healing would change the prompt an echo returns, and a constrained output must
            # follow its grammar from the first token: neither is healed.
            heal = (not req.echo and self.constraint is None and not req.resume_token_ids
                    and self._heals(req.prompts[i] if not req.chat else None))
            for j in range(req.n):
                max_tokens = req.max_tokens
                done = len(req.resume_token_ids or ())
                if max_tokens is not None:
                    max_tokens -= done
                if max_tokens is None:  # chat default: whatever the context has room for
                    max_tokens = max(1, engine.max_model_len - len(ids))
                params = SamplingParams(
                    max_tokens=max_tokens, temperature=req.temperature, top_p=req.top_p, top_k=req.top_k,
                    seed=None if req.seed is None else req.seed + j, stop=list(req.stop),
                    stop_token_ids=list(req.stop_token_ids), ignore_eos=req.ignore_eos,
                    skip_special_tokens=not self.keep_special_tokens,
                    presence_penalty=req.presence_penalty, frequency_penalty=req.frequency_penalty,
                    repetition_penalty=req.repetition_penalty, logit_bias=dict(req.logit_bias),
                    min_tokens=max(0, req.min_tokens - done), bad_words_ids=bad_words, allowed_token_ids=req.allowed_token_ids,
                    logprobs=req.logprobs, prompt_logprobs=prompt_logprobs, constraint=self.constraint,
                    token_healing=heal, resume=self.resume)
                try:
                    params.validate()
                    engine.validate_request(ids, params, req.priority)
                except InvalidRequest as e:
                    raise APIError(str(e), 400, param=_param_of(str(e))) from None
                index = i * req.n + j
                self.choices.append(Choice(index, f"{self.id}-{index}", i))
                self._params.append(params)

    def _heals(self, prompt) -> bool:
        """Whether a prompt is healed: the request's own field, else server.token_healing
        (auto: a completion prompt given as text; chat and token ids are left as they are)."""
        if self.req.token_healing is not None:
            return self.req.token_healing
        mode = {True: "on", False: "off"}.get(self.token_healing, self.token_healing)
        return mode == "on" or (mode == "auto" and isinstance(prompt, str))

    def engine_prompt(self, prompt_index: int) -> list[int]:
        """The prompt's token ids as the engine runs them (without healed tokens)."""
        ids = self.prompt_token_ids[prompt_index]
        return ids[:self.engine_prompt_tokens.get(prompt_index, len(ids))]

    @property
    def num_prompt_tokens(self) -> int:
        return sum(len(self.engine_prompt(i)) for i in range(len(self.prompt_token_ids)))

    @property
    def num_completion_tokens(self) -> int:
        return sum(c.num_output_tokens for c in self.choices)

    def usage(self) -> dict[str, int]:
        p, c = self.num_prompt_tokens, self.num_completion_tokens
        return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}

    # ---- after submission --------------------------------------------------------------------
    async def outputs(self) -> AsyncIterator[tuple[Choice, object]]:
        """Submit every choice and yield ``(choice, RequestOutput)`` as the engine produces them.

        Raises EngineFailure if the engine fails a request. On exit — normal, exception, or
        cancellation because the client went away — unfinished choices are aborted.
        """
        try:
            for c, params in zip(self.choices, self._params):
                self.aengine.submit(c.rid, self.prompt_token_ids[c.prompt_index], params, self._sink, c,
                                    self.arrival, self.req.priority)
                self._open.add(c.rid)
            while self._open:
                c, out = await self._sink.get()
                if isinstance(out, Exception):
                    self._open.discard(c.rid)
                    raise out
                c.text.append(out.new_text)
                c.token_ids.extend(out.new_token_ids)
                self.engine_prompt_tokens[c.prompt_index] = out.num_prompt_tokens
                c.num_output_tokens = out.num_output_tokens
                c.logprobs.extend(out.new_logprobs)
                if out.prompt_logprobs is not None:
                    c.prompt_logprobs = out.prompt_logprobs
                if out.finished:
                    c.finish_reason = out.finish_reason
                    self._open.discard(c.rid)
                    if out.finish_reason == "error":  # the engine already freed its pages
                        raise EngineFailure(f"the engine failed while generating choice {c.index}; "
                                            f"see the server log")
                yield c, out
        finally:
            self.abort()

    def abort(self) -> None:
        for rid in self._open:
            self.aengine.abort(rid)
        self._open.clear()


def _encode(tok, text: str, add_special_tokens: bool) -> list[int]:
    try:
        return list(tok.encode(text, add_special_tokens=add_special_tokens))
    except TypeError:  # a tokenizer whose encode has no such switch
        return list(tok.encode(text))


def _word_ids(tok, word: str) -> list[list[int]]:
    """A bad word's token sequences, as vLLM bans them: the word alone and after a space."""
    seqs = [_encode(tok, word, add_special_tokens=False), _encode(tok, " " + word, add_special_tokens=False)]
    return [s for i, s in enumerate(seqs) if s and s not in seqs[:i]]


def _param_of(message: str) -> str | None:
    """The request field an engine message is about, for the ``param`` of the error JSON."""
    for name in ("priority", "logit_bias", "bad_words", "allowed_token_ids", "min_tokens", "repetition_penalty",
                 "presence_penalty", "frequency_penalty", "prompt_logprobs", "logprobs",
                 "max_tokens", "temperature", "top_p", "top_k", "seed", "stop_token_ids", "stop", "prompt"):
        if name in message:
            return name
    return None


__all__ = ["Generation", "Choice", "EngineFailure"]
