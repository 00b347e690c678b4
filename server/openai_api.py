"""The OpenAI-compatible endpoints: /v1/completions, /v1/chat/completions, /v1/models.

Streaming answers are Server-Sent Events: one ``data: {json}`` chunk per engine delta, a final
chunk with ``finish_reason``, an optional usage chunk (``stream_options.include_usage``), then
``data: [DONE]``. Chunk shapes follow OpenAI's (``text_completion`` and
``chat.completion.chunk``) so the ``openai`` client parses them unchanged.

A stream starts only once its first event is in: a request the engine refuses or fails before
its first token (no prefill node connected, the server at capacity, a failed first forward pass)
gets the HTTP status, ``Retry-After`` and error JSON a non-streaming request gets, not a 200 with
an error inside. Once the first chunk is out, a failure can only be told in-band: an error chunk,
then ``[DONE]``.
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any, AsyncIterator

from aiohttp import web

from pdkv.server.async_engine import EngineFailure
from pdkv.server.chat_output import ChatOutput, OutputParsers
from pdkv.server.errors import APIError, error_body
from pdkv.server.generate import Choice, Generation
from pdkv.server.logprobs_format import LogprobsFormatter
from pdkv.server.protocol import GenerateRequest, parse_chat, parse_completion
from pdkv.server.protocol_structured import tool_call_schema
from pdkv.server.structured import Grammars

log = logging.getLogger(__name__)


class OpenAIRoutes:
    def __init__(self, aengine, model_name: str, model_root: str, max_body_bytes: int,
                 max_prompts_x_n: int = 256, server_config=None):
        """``server_config``: the ServerConfig (grammar cache, prompt logprobs bound, parsers)."""
        from pdkv.config import ServerConfig  # noqa: PLC0415

        self.sc = server_config or ServerConfig()
        self.grammars: Grammars | None = None  # set with the engine (set_engine)
        self.parsers: OutputParsers | None = None
        self.formatter: LogprobsFormatter | None = None
        self.aengine = aengine
        self.token_healing = self.sc.token_healing
        self.max_prompts_x_n = max_prompts_x_n
        self.model_name = model_name
        self.model_root = model_root
        self.max_body_bytes = max_body_bytes
        self.created = int(time.time())

    def set_engine(self, aengine) -> None:
        self.aengine = aengine
        engine = aengine.engine
        self.grammars = Grammars(engine, self.sc.grammar_cache_size, self.sc.grammar_compile_timeout_s)
        self.parsers = OutputParsers.build(self.sc, engine)
        self.formatter = LogprobsFormatter(engine.tokenizer)

    def add_to(self, app: web.Application) -> None:
        app.router.add_get("/v1/models", self.models)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat)

    async def models(self, request: web.Request) -> web.Response:
        card = {"id": self.model_name, "object": "model", "created": self.created, "owned_by": "pdkv",
                "root": self.model_root, "max_model_len": self.aengine.engine.max_model_len}
        return web.json_response({"object": "list", "data": [card]})

    async def completions(self, request: web.Request) -> web.StreamResponse:
        req = parse_completion(await self._json(request))
        return await self._serve(request, req, "cmpl")

    async def chat(self, request: web.Request) -> web.StreamResponse:
        req = parse_chat(await self._json(request))
        return await self._serve(request, req, "chatcmpl")

    # ---- shared ------------------------------------------------------------------------------
    async def _json(self, request: web.Request) -> Any:
        if request.content_length is not None and request.content_length > self.max_body_bytes:
            raise web.HTTPRequestEntityTooLarge(max_size=self.max_body_bytes, actual_size=request.content_length)
        raw = await request.read()  # aiohttp enforces client_max_size while reading chunked bodies
        if not raw:
            raise APIError("the request body is empty; send a JSON object")
        try:
            body = json.loads(raw)
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise APIError(f"the request body is not valid JSON: {e}") from None
        except RecursionError:
            raise APIError("the request body is nested too deeply to be a request") from None
        try:  # a JSON escape like "\ud800" decodes to a lone surrogate, which no tokenizer takes
            json.dumps(body, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError as e:
            raise APIError(f"the request body contains a lone UTF-16 surrogate ({e.object[e.start:e.end]!r} "
                           f"is not valid Unicode text)") from None
        except RecursionError:
            raise APIError("the request body is nested too deeply to be a request") from None
        return body

    async def _serve(self, request: web.Request, req: GenerateRequest, prefix: str) -> web.StreamResponse:
        if req.model is not None and req.model != self.model_name:
            raise APIError(f"the model '{req.model}' does not exist; this server serves '{self.model_name}' "
                           f"(see GET /v1/models)", 404, param="model", code="model_not_found")
        count = (1 if req.chat else len(req.prompts)) * req.n
        if count > self.max_prompts_x_n:  # each is one engine request: 400 x 16 made 6,400 before
            raise APIError(f"this request asks for {count} completions (prompts x n); the limit is "
                           f"{self.max_prompts_x_n} (server.max_prompts_x_n)", 400, param="n")
        if not self.aengine.is_alive():
            raise APIError("the engine is not running", 503)
        spec = tool_call_schema(req.tools) if req.tools is not None else None
        if spec is not None and req.structured is not None:
            raise APIError(f"tool_choice {req.tools.choice!r} and {req.structured.field} cannot both constrain "
                           f"the output", 400, param=req.structured.field)
        spec = spec or req.structured
        constraint = await self.grammars.constraint(spec) if spec is not None else None
        if constraint is not None and req.chat and self.parsers.reasoning:  # the answer only
            constraint = self.grammars.after_reasoning(constraint)
        # As vLLM: tool-call markers may be special tokens, which the parser must see.
        parsing = req.tools is not None and req.tools.choice == "auto" and self.parsers.tools is not None
        gen = Generation(self.aengine, req, prefix, constraint, self.sc.max_prompt_logprobs_tokens, parsing,
                         self.token_healing)
        gen.prepare()
        try:
            if req.stream:
                return await self._stream(request, gen)
            return await self._collect(gen)
        finally:
            gen.abort()  # the client left or something failed: free every unfinished request

    async def _collect(self, gen: Generation) -> web.Response:
        try:
            async for _ in gen.outputs():
                pass
        except EngineFailure as e:
            raise _api_error(e) from None
        chat, req = gen.req.chat, gen.req
        choices = []
        for c in gen.choices:
            text = "".join(c.text)
            choice: dict[str, Any] = {"index": c.index, "logprobs": None, "finish_reason": c.finish_reason}
            if chat:
                out = ChatOutput(self.parsers, req)
                choice["message"] = out.message(text)
                choice["finish_reason"] = out.finish_reason(c.finish_reason)
                if req.logprobs is not None:
                    choice["logprobs"] = self.formatter.chat(c.logprobs)
            else:
                prompt = self._echo(gen, c)
                choice["text"] = prompt + text
                if req.logprobs is not None:
                    choice["logprobs"] = self.formatter.completion(
                        c.logprobs, 0, gen.prompt_token_ids[c.prompt_index] if req.echo else None,
                        c.prompt_logprobs)
            if gen.req.return_token_ids:
                choice["token_ids"] = c.token_ids
            choices.append(choice)
        body = {"id": gen.id, "object": "chat.completion" if chat else "text_completion", "created": gen.created,
                "model": self.model_name, "choices": choices, "usage": gen.usage()}
        if gen.req.return_token_ids:
            body["prompt_token_ids"] = [gen.engine_prompt(i) for i in range(len(gen.prompt_token_ids))]
        return web.json_response(body)

    def _echo(self, gen: Generation, c: Choice) -> str:
        if not gen.req.echo:
            return ""
        p = gen.req.prompts[c.prompt_index]
        return p if isinstance(p, str) else self.aengine.engine.tokenizer.decode(p)

    async def _stream(self, request: web.Request, gen: Generation) -> web.StreamResponse:
        events = gen.outputs()
        try:
            # Nothing is sent before the first event: a failure now still has its HTTP status.
            # (A client that leaves meanwhile cancels this handler; _serve's finally aborts.)
            first = None
            try:
                async for c, out in events:
                    if _sendable(gen.req, out):
                        first = (c, out)
                        break  # (the generator stays open: _send_stream goes on with it)
            except EngineFailure as e:
                raise _api_error(e) from None
            return await self._send_stream(request, gen, first, events)
        finally:
            await events.aclose()

    async def _send_stream(self, request: web.Request, gen: Generation, first, events) -> web.StreamResponse:
        """Stream ``first`` (the first ``(choice, output)``, None if there is none) and the rest of ``events``."""
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                           "X-Accel-Buffering": "no"})
        try:
            await resp.prepare(request)
        except (ConnectionResetError, OSError):  # the client left before the first byte: nothing to say
            log.info("client disconnected from %s before its stream started", gen.id)
            return resp
        chat, req = gen.req.chat, gen.req
        obj = "chat.completion.chunk" if chat else "text_completion"
        started: set[int] = set()
        outs = {c.index: ChatOutput(self.parsers, req) for c in gen.choices} if chat else {}
        # a resumed chat stream: its output parser (reasoning) sees the text the client has first
        # (what it gives out for it the client had); ``fed``: the output text fed per choice, what
        # a router counts to resume a chat stream (its deltas drop the reasoning tags)
        fed = {c.index: len(gen.resume_replay) for c in gen.choices}
        for out in outs.values():
            if gen.resume_replay:
                out.delta(gen.resume_replay)
        sent_lps = {c.index: 0 for c in gen.choices}  # logprob records already sent per choice
        offsets = {c.index: 0 for c in gen.choices}

        async def send(payload: dict[str, Any] | str) -> None:
            data = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False)
            await resp.write(f"data: {data}\n\n".encode())

        def chunk(choice: dict[str, Any] | None, usage: dict | None = None) -> dict[str, Any]:
            body = {"id": gen.id, "object": obj, "created": gen.created, "model": self.model_name,
                    "choices": [] if choice is None else [choice]}
            if usage is not None:
                body["usage"] = usage
            return body

        def choice_of(c: Choice, text: str, token_ids: list[int], finish: str | None) -> dict[str, Any]:
            records = c.logprobs[sent_lps[c.index]:len(c.logprobs)] if req.logprobs is not None else []
            sent_lps[c.index] = len(c.logprobs)
            if chat:
                out = outs[c.index]
                delta = out.delta(text)
                if finish is not None:
                    delta = out.merge(delta, out.end())
                    finish = out.finish_reason(finish)
                ch = {"index": c.index, "delta": delta, "finish_reason": finish,
                      "logprobs": self.formatter.chat(records) if req.logprobs is not None else None}
            else:
                first = c.index not in started
                echo = self._echo(gen, c) if first else ""
                lps = None
                if req.logprobs is not None:
                    lps = self.formatter.completion(
                        records, offsets[c.index], gen.prompt_token_ids[c.prompt_index] if req.echo and first
                        else None, c.prompt_logprobs)
                    offsets[c.index] += len(echo) + len(text)
                ch = {"index": c.index, "text": echo + text, "logprobs": lps, "finish_reason": finish}
            if req.return_token_ids:
                ch["token_ids"] = token_ids
                if chat:
                    fed[c.index] += len(text)
                    ch["pdkv_text_chars"] = fed[c.index]
                if c.index not in started:
                    ch["prompt_token_ids"] = gen.engine_prompt(c.prompt_index)
            return ch

        try:
            if chat:  # OpenAI opens every chat choice with the assistant role
                for c in gen.choices:
                    await send(chunk({"index": c.index, "delta": {"role": "assistant", "content": ""},
                                      "logprobs": None, "finish_reason": None}))
            try:
                async for c, out in _chain(first, events):
                    if _sendable(req, out):
                        await send(chunk(choice_of(c, out.new_text, list(out.new_token_ids),
                                                   out.finish_reason if out.finished else None)))
                        started.add(c.index)
            except EngineFailure as e:
                await send(error_body(str(e), e.status, code="engine_error"))
            else:
                if req.include_usage:
                    await send(chunk(None, usage=gen.usage()))
            await send("[DONE]")
            await resp.write_eof()
        except ConnectionResetError:
            # The client went away mid-stream; _serve's finally aborts what is left.
            log.info("client disconnected from %s; aborting its requests", gen.id)
        return resp


def _api_error(e: EngineFailure) -> APIError:
    """What a client is told about an engine failure before anything was sent to it."""
    return APIError(str(e), e.status, code="engine_error",
                    headers=None if e.retry_after is None else {"Retry-After": str(e.retry_after)})


def _sendable(req: GenerateRequest, out) -> bool:
    """Whether ``out`` makes a chunk (a step may add a token whose text is held back, e.g. a
    possible stop string's start)."""
    return bool(out.new_text or (req.return_token_ids and out.new_token_ids) or out.finished)


async def _chain(first, events: AsyncIterator) -> AsyncIterator:
    """``first`` (unless None), then the rest of ``events``."""
    if first is not None:
        yield first
    async for item in events:
        yield item
