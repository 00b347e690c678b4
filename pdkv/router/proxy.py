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

from pdkv.router.metrics import RouterMetrics
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
                 prefix_chars: int, retry_after_s: int = 1):
        self.nodes = nodes
        self.policy = policy
        self.metrics = metrics
        self.session = session
        self.prefix_chars = prefix_chars
        self.retry_after_s = retry_after_s

    def healthy(self) -> list[Node]:
        return [n for n in self.nodes if n.healthy]

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
        tried: set[str] = set()
        failures: list[str] = []
        while True:
            candidates = [n for n in self.healthy() if n.url not in tried]
            if not candidates:
                if failures:  # every node tried failed before answering: say which and how
                    return error_response(f"no node could answer: {'; '.join(failures)}", 502, "node_failed")
                return self.no_node()
            node, how = self.policy.choose(candidates, key)
            self.metrics.choices.labels(how.value).inc()
            tried.add(node.url)
            resp = await self._send(request, node, body, headers, failures)
            if resp is not None:
                return resp

    async def _send(self, request: web.Request, node: Node, body: bytes, headers: dict,
                    failures: list[str]) -> web.StreamResponse | None:
        """The node's answer relayed, or None when the node failed before its response began (it
        refused the connection, or died before sending a status line): nothing reached the client,
        so another node may serve it; ``failures`` gets a line naming the node."""
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
                resp_headers = {k: v for k, v in upstream.headers.items() if k.lower() not in _HOP}
                resp_headers["X-Pdkv-Node"] = node.url
                streaming = upstream.headers.get("Content-Type", "").startswith("text/event-stream")
                if not streaming:
                    data = await upstream.read()
                    self.metrics.requests.labels(node.url, "ok" if upstream.status < 500 else "error").inc()
                    return web.Response(body=data, status=upstream.status, headers=resp_headers)
                out = web.StreamResponse(status=upstream.status, headers=resp_headers)
                await out.prepare(request)
                async for chunk in upstream.content.iter_any():
                    await out.write(chunk)  # as it arrives: no re-framing, no buffering
                await out.write_eof()
                self.metrics.requests.labels(node.url, "ok").inc()
                return out
        except (aiohttp.ClientPayloadError, aiohttp.ClientConnectionError, asyncio.TimeoutError, OSError) as e:
            if out is None:  # broke before anything was sent on: the client gets a 502 naming it
                self.metrics.requests.labels(node.url, "failed").inc()
                node.mark(NodeHealth.DOWN, f"{type(e).__name__}: {e}")
                return error_response(f"node {node.url} failed before answering: {type(e).__name__}: {e}", 502,
                                      "node_failed")
            if request.transport is None or request.transport.is_closing():
                raise  # our own client left; nothing to tell
            node.mark(NodeHealth.DOWN, f"stream broke: {type(e).__name__}: {e}")
            self.metrics.requests.labels(node.url, "failed").inc()
            log.warning("stream from %s broke: %s", node.url, e)
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
