"""Forwarding one OpenAI request to a node and its answer back, streaming without buffering.

A streamed answer (text/event-stream) is written on as each chunk arrives from the node; when
the client goes away, aiohttp cancels the handler (``handler_cancellation``), which closes the
upstream response, so the node sees its client disconnect and aborts the request. A node that
fails before its response began (connection refused, or it died before a status line) is taken
out and the request goes to another node: nothing reached the client, so the answer it gets is
still one whole answer (at worst the dead node's work is repeated); with no other node left,
a 502 names the node(s). One that breaks mid-stream cannot be retried (tokens
were already sent): the client gets an SSE error event naming the node, then the stream ends.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time

import aiohttp
from aiohttp import web

from pdkv.router.migrate import StreamState, migratable
from pdkv.router.metrics import RouterMetrics
from pdkv.fleet.drain import DRAINING_HEADER
from pdkv.router.nodes import Node, NodeHealth
from pdkv.router.policy import Policy, prefix_key

log = logging.getLogger(__name__)

# Request headers passed to the node (hop-by-hop ones and Host are not).
_FORWARD = ("Authorization", "Content-Type", "Accept", "X-Request-Id")
_HOP = {"transfer-encoding", "connection", "keep-alive", "content-length", "content-encoding", "server", "date"}


def error_response(message: str, status: int, code: str, headers: dict | None = None) -> web.Response:
    body = {"error": {"message": message, "type": "router_error", "param": None, "code": code}}
    return web.json_response(body, status=status, headers=headers)


def sse_error(message: str, code: str) -> bytes:
    body = {"error": {"message": message, "type": "router_error", "param": None, "code": code}}
    return b"data: " + json.dumps(body).encode() + b"\n\n"


class Proxy:
    def __init__(self, nodes: list[Node], policy: Policy, metrics: RouterMetrics, session: aiohttp.ClientSession,
                 prefix_chars: int, retry_after_s: int = 1, migration_limit: int = 0,
                 migration_max_tokens: int = 4096):
        self.nodes = nodes
        self.policy = policy
        self.metrics = metrics
        self.session = session
        self.prefix_chars = prefix_chars
        self.retry_after_s = retry_after_s
        self.migration_limit, self.migration_max_tokens = migration_limit, migration_max_tokens

    def healthy(self) -> list[Node]:
        """The nodes new requests may go to: in, and not draining."""
        return [n for n in self.nodes if n.choosable]

    def no_node(self) -> web.Response:
        self.metrics.no_node.inc()
        why = "; ".join(f"{n.url}: {n.health.value}{' (' + n.last_error + ')' if n.last_error else ''}"
                        for n in self.nodes)
        return error_response(f"no healthy node to serve the request ({why})", 503, "no_healthy_node",
                              headers={"Retry-After": str(self.retry_after_s)})

    async def forward(self, request: web.Request) -> web.StreamResponse:
        body = await request.read()
        try:
            parsed = json.loads(body)
        except ValueError:
            parsed = None  # the node answers the 400 (same message as without a router)
        key = prefix_key(parsed, self.prefix_chars) if isinstance(parsed, dict) else None
        headers = {h: request.headers[h] for h in _FORWARD if h in request.headers}
        state = None
        if isinstance(parsed, dict) and migratable(parsed, self.migration_limit):
            state = StreamState(chat=request.path.endswith("/chat/completions"),
                                client_token_ids=parsed.get("return_token_ids") is True)
            body = json.dumps({**parsed, "return_token_ids": True}).encode()
        tried: set[str] = set()
        failures: list[str] = []
        retries = self.migration_limit  # 503s before anything reached the client, sent again
        while True:
            candidates = [n for n in self.healthy() if n.url not in tried]
            if not candidates and retries > 0 and failures and failures[-1].endswith("(503)"):
                candidates = self.healthy()  # a node that shed or lost its prefill node: again
            if not candidates:
                if failures and all(f.endswith(("(503)", "(draining)")) for f in failures):
                    self.metrics.no_node.inc()  # each one draining or busy: worth a retry shortly
                    return error_response(f"no node can take the request now: {'; '.join(failures)}", 503,
                                          "no_node_available", headers={"Retry-After": str(self.retry_after_s)})
                if failures:  # every node tried failed before answering: say which and how
                    return error_response(f"no node could answer: {'; '.join(failures)}", 502, "node_failed")
                return self.no_node()
            node, how = self.policy.choose(candidates, key)
            self.metrics.choices.labels(how.value).inc()
            tried.add(node.url)
            resp = await self._send(request, node, body, headers, failures, state, parsed, retries > 0)
            if resp is not None:
                return resp
            if failures and failures[-1].endswith("(503)"):
                retries -= 1

    async def _send(self, request: web.Request, node: Node, body: bytes, headers: dict,
                    failures: list[str], state: StreamState | None = None, parsed: dict | None = None,
                    may_retry: bool = False) -> web.StreamResponse | None:
        """The node's answer relayed, or None when the node failed before its response began (it
        refused the connection, died before sending a status line, or answered 503 while another
        try is allowed): nothing reached the client, so another node may serve it; ``failures``
        gets a line naming the node. ``state``: the stream migrates if the node breaks mid-way."""
        t0 = time.perf_counter()
        node.in_flight += 1
        self.metrics.observe_node(node)
        out: web.StreamResponse | None = None
        try:
            try:
                upstream = await self.session.request(request.method, node.url + request.rel_url.path_qs,
                                                      data=body, headers=headers)
            except (aiohttp.ClientConnectionError, OSError) as e:
                node.mark(NodeHealth.DOWN, f"failed before answering: {type(e).__name__}: {e}")
                self.metrics.requests.labels(node.url, "failed").inc()
                failures.append(f"node {node.url} failed before answering ({type(e).__name__}: {e})")
                return None
            async with upstream:
                self.metrics.first_byte.labels(node.url).observe(time.perf_counter() - t0)
                if upstream.status == 503 and (may_retry or upstream.headers.get(DRAINING_HEADER)):
                    # nothing started there: draining, shedding, or its prefill node died
                    text = (await upstream.text())[:300]
                    draining = bool(upstream.headers.get(DRAINING_HEADER))
                    if draining:
                        node.draining = True
                    self.metrics.retries.labels("draining" if draining else "unavailable").inc()
                    self.metrics.requests.labels(node.url, "error").inc()
                    failures.append(f"node {node.url} answered {text} ({'draining' if draining else '503'})")
                    return None
                resp_headers = {k: v for k, v in upstream.headers.items() if k.lower() not in _HOP}
                resp_headers["X-Pdkv-Node"] = node.url
                streaming = upstream.headers.get("Content-Type", "").startswith("text/event-stream")
                if not streaming:
                    data = await upstream.read()
                    self.metrics.requests.labels(node.url, "ok" if upstream.status < 500 else "error").inc()
                    return web.Response(body=data, status=upstream.status, headers=resp_headers)
                out = web.StreamResponse(status=upstream.status, headers=resp_headers)
                await out.prepare(request)
                if state is None:
                    async for chunk in upstream.content.iter_any():
                        await out.write(chunk)  # as it arrives: no re-framing, no buffering
                    await out.write_eof()
                    self.metrics.requests.labels(node.url, "ok").inc()
                    return out
                async for chunk in upstream.content.iter_any():
                    data = state.feed(chunk, False)
                    if data:
                        await out.write(data)
                if state.done or state.finished and state.error is None:
                    await out.write_eof()
                    self.metrics.requests.labels(node.url, "ok").inc()
                    return out
                cause = "node_error" if state.error else "stream_cut"
                why = state.error or "the stream ended before [DONE]"
                raise _Broken(cause, why)
        except (aiohttp.ClientPayloadError, aiohttp.ClientConnectionError, asyncio.TimeoutError, OSError,
                _Broken) as e:
            if out is None:  # broke before anything was sent on: the client gets a 502 naming it
                self.metrics.requests.labels(node.url, "failed").inc()
                node.mark(NodeHealth.DOWN, f"{type(e).__name__}: {e}")
                return error_response(f"node {node.url} failed before answering: {type(e).__name__}: {e}", 502,
                                      "node_failed")
            if request.transport is None or request.transport.is_closing():
                raise  # our own client left; nothing to tell
            cause = e.cause if isinstance(e, _Broken) else "node_failed"
            if not isinstance(e, _Broken):
                node.mark(NodeHealth.DOWN, f"stream broke: {type(e).__name__}: {e}")
            self.metrics.requests.labels(node.url, "failed").inc()
            log.warning("stream from %s broke: %s", node.url, e)
            if state is not None and await self._migrate(request, out, node, headers, state, parsed, cause):
                return out
            try:
                await out.write(sse_error(f"node {node.url} failed mid-stream ({type(e).__name__}: {e}); the "
                                          f"request was not completed", "node_failed"))
                await out.write_eof()
            except (ConnectionError, RuntimeError):
                pass
            return out
        finally:
            node.in_flight -= 1
            self.metrics.latency.labels(node.url).observe(time.perf_counter() - t0)
            self.metrics.observe_node(node)

    async def _migrate(self, request: web.Request, out: web.StreamResponse, failed: Node, headers: dict,
                       state: StreamState, parsed: dict, cause: str) -> bool:
        """Go on with the stream on other nodes (pdkv/router/migrate.py); True once it completed."""
        exclude = {failed.url}
        for _ in range(self.migration_limit):
            if len(state.token_ids) > self.migration_max_tokens:
                log.warning("not migrating a stream of %d tokens (migration_max_tokens %d)", len(state.token_ids),
                            self.migration_max_tokens)
                break
            candidates = [n for n in self.healthy() if n.url not in exclude]
            if not candidates:
                break
            node, _ = self.policy.choose(candidates, None)
            exclude.add(node.url)
            body = json.dumps(state.resume_body(parsed)).encode()
            state.error = None
            node.in_flight += 1
            try:
                async with self.session.request(request.method, node.url + request.rel_url.path_qs, data=body,
                                                headers=headers) as upstream:
                    if upstream.status != 200:
                        log.warning("migration to %s refused: %d %s", node.url, upstream.status,
                                    (await upstream.text())[:200])
                        self.metrics.migrations.labels(cause, "failed").inc()
                        continue
                    async for chunk in upstream.content.iter_any():
                        data = state.feed(chunk, True)
                        if data:
                            await out.write(data)
                if state.done or state.finished and state.error is None:
                    await out.write_eof()
                    self.metrics.migrations.labels(cause, "ok").inc()
                    log.info("stream migrated from %s to %s after %d tokens (%s)", failed.url, node.url,
                             state.resumed, cause)
                    return True
                self.metrics.migrations.labels(cause, "failed").inc()
                cause = "node_error" if state.error else "stream_cut"
            except (aiohttp.ClientPayloadError, aiohttp.ClientConnectionError, asyncio.TimeoutError, OSError) as e:
                if request.transport is None or request.transport.is_closing():
                    raise
                node.mark(NodeHealth.DOWN, f"stream broke: {type(e).__name__}: {e}")
                self.metrics.migrations.labels(cause, "failed").inc()
                cause = "node_failed"
            finally:
                node.in_flight -= 1
        return False


class _Broken(Exception):
    """A migrating stream that ended without [DONE] or with an error event."""

    def __init__(self, cause: str, why: str):
        super().__init__(why)
        self.cause = cause
