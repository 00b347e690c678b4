"""The open-loop streaming client: every request is sent at its scheduled offset whether or not
earlier ones finished (an arrival process, not a closed loop), and every SSE chunk is timestamped.

A request ends in exactly one way: ``ok`` (``[DONE]`` after exactly max_tokens tokens) or
``error`` with a message that says what happened (HTTP status and the server's message, a
refused connection, a stream cut after k of n tokens, an error event, a timeout). The client also
measures itself: how late each send was against its schedule, the time spent parsing each chunk,
and its CPU time, so a report can show the client was not the bottleneck.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import time
from dataclasses import dataclass, field
from typing import Callable

import aiohttp


@dataclass
class RequestResult:
    id: str
    url: str
    scheduled_s: float  # offset it was due at
    sent_s: float = 0.0  # offset it was actually sent at (send lag = sent_s - scheduled_s)
    status: str = "error"  # ok | error
    error: str | None = None
    http_status: int | None = None
    ttft_s: float | None = None  # sent -> first token
    e2e_s: float | None = None  # sent -> [DONE]
    num_tokens: int = 0
    usage_tokens: int | None = None  # the server's own count (usage chunk)
    chunk_s: list[float] = field(default_factory=list)  # arrival of each chunk with tokens, after sending
    chunk_tokens: list[int] = field(default_factory=list)
    parse_s: float = 0.0  # client time spent handling this request's chunks
    body_sha256: str = ""  # of the bytes actually POSTed (identical workloads are checked on this)


def _error_text(raw: bytes) -> str:
    try:
        return json.loads(raw)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return raw[:200].decode(errors="replace")


def _on_event(res: RequestResult, event: bytes, max_tokens: int, start: float, t: float) -> bool:
    """Account one SSE event that arrived at ``t``; True at [DONE]. Sets ``res.error`` on an error event."""
    for line in event.split(b"\n"):
        if not line.startswith(b"data: "):
            continue
        data = line[6:].strip()
        if data == b"[DONE]":
            return True
        try:
            ev = json.loads(data)
        except ValueError:
            res.error = f"not JSON in the event stream after {res.num_tokens} of {max_tokens} tokens: {data[:80]!r}"
            return False
        if "error" in ev:
            msg = ev["error"].get("message") if isinstance(ev["error"], dict) else ev["error"]
            res.error = f"error event after {res.num_tokens} of {max_tokens} tokens: {msg}"
            return False
        if ev.get("usage"):
            res.usage_tokens = ev["usage"].get("completion_tokens")
        for ch in ev.get("choices") or ():
            n = len(ch["token_ids"]) if "token_ids" in ch else (1 if ch.get("text") else 0)
            if n:
                if res.ttft_s is None:
                    res.ttft_s = t - start
                res.chunk_s.append(t - start)
                res.chunk_tokens.append(n)
                res.num_tokens += n
    return False


async def _one(session: aiohttp.ClientSession, res: RequestResult, body: bytes, max_tokens: int, t0: float,
               timeout: float) -> None:
    now = time.perf_counter()
    if res.scheduled_s > now - t0:
        await asyncio.sleep(res.scheduled_s - (now - t0))
    res.body_sha256 = hashlib.sha256(body).hexdigest()
    start = time.perf_counter()
    res.sent_s = start - t0
    done = False
    try:
        async with session.post(res.url + "/v1/completions", data=body,
                                headers={"Content-Type": "application/json"},
                                timeout=aiohttp.ClientTimeout(total=timeout)) as resp:
            res.http_status = resp.status
            if resp.status != 200:
                res.error = f"HTTP {resp.status}: {_error_text(await resp.read())}"
                return
            buf = b""
            async for piece in resp.content.iter_any():  # events may exceed aiohttp's line limit
                t = time.perf_counter()
                buf += piece
                *events, buf = buf.split(b"\n\n")
                for event in events:
                    if _on_event(res, event, max_tokens, start, t):
                        done = True
                    if res.error or done:
                        break
                res.parse_s += time.perf_counter() - t
                if res.error or done:
                    break
            if res.error:
                return
    except asyncio.TimeoutError:
        res.error = f"no complete answer within {timeout:g} s ({res.num_tokens} of {max_tokens} tokens)"
        return
    except aiohttp.ClientConnectorError as e:
        res.error = f"cannot connect to {res.url}: {e.os_error.strerror if e.os_error else e}"
        return
    except (aiohttp.ClientError, ConnectionError) as e:
        res.error = (f"connection lost after {res.num_tokens} of {max_tokens} tokens "
                     f"({type(e).__name__}: {e or 'the server closed the stream'})")
        return
    res.e2e_s = time.perf_counter() - start
    if not done:
        res.error = f"stream ended without [DONE] after {res.num_tokens} of {max_tokens} tokens"
    elif res.num_tokens != max_tokens:
        res.error = f"got {res.num_tokens} tokens, asked for exactly {max_tokens} (ignore_eos)"
    else:
        res.status = "ok"


async def _replay(urls: list[str], jobs: list[tuple[str, float, bytes, int]], timeout: float,
                  on_done: Callable[[], None] | None, t0: float) -> tuple[list[RequestResult], float]:
    conn = aiohttp.TCPConnector(limit=0, force_close=False)
    async with aiohttp.ClientSession(connector=conn) as session:
        results = [RequestResult(rid, urls[i % len(urls)], off) for i, (rid, off, _, _) in enumerate(jobs)]

        async def run(res, body, n):
            await _one(session, res, body, n, t0, timeout)
            if on_done:
                on_done()

        await asyncio.gather(*(run(r, body, n) for r, (_, _, body, n) in zip(results, jobs)))
        return results, t0


def replay(urls: list[str], jobs: list[tuple[str, float, bytes, int]], timeout: float = 600.0,
           on_done: Callable[[], None] | None = None, t0: float | None = None) -> tuple[list[RequestResult], float, float]:
    """Send ``jobs`` = [(id, offset_s, body, max_tokens)] open-loop, round-robin over ``urls``, offsets
    counted from ``t0`` on time.perf_counter's clock (default: 0.2 s from now).
    Returns (results, t0, client CPU seconds)."""
    cpu0 = time.process_time()
    t0 = time.perf_counter() + 0.2 if t0 is None else t0
    results, t0 = asyncio.run(_replay(urls, jobs, timeout, on_done, t0))
    return results, t0, time.process_time() - cpu0


def reachable(url: str, timeout: float = 5.0) -> str | None:
    """None if ``url`` answers GET /v1/models, else why not (for a clear error before a replay)."""
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(url.rstrip("/") + "/v1/models", timeout=timeout) as r:
            json.loads(r.read())
        return None
    except urllib.error.HTTPError as e:
        return f"GET {url}/v1/models answered HTTP {e.code}"
    except (OSError, ValueError) as e:
        reason = getattr(e, "reason", e)
        return f"GET {url}/v1/models failed: {reason}"


def first_model(url: str) -> str:
    import urllib.request

    with urllib.request.urlopen(url.rstrip("/") + "/v1/models", timeout=5) as r:
        return json.loads(r.read())["data"][0]["id"]


async def _closed_loop(url: str, bodies: Callable[[int], tuple[bytes, int]], concurrency: int, duration_s: float,
                       timeout: float) -> list[RequestResult]:
    conn = aiohttp.TCPConnector(limit=0, force_close=False)
    async with aiohttp.ClientSession(connector=conn) as session:
        t0 = time.perf_counter()
        results: list[RequestResult] = []

        async def worker() -> None:
            while time.perf_counter() - t0 < duration_s:
                i = len(results)
                body, n = bodies(i)
                res = RequestResult(f"c{i:05d}", url, time.perf_counter() - t0)
                results.append(res)
                await _one(session, res, body, n, t0, timeout)

        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return results


def closed_loop(url: str, bodies: Callable[[int], tuple[bytes, int]], concurrency: int, duration_s: float,
                timeout: float = 600.0) -> tuple[list[RequestResult], float]:
    """``concurrency`` streams, each sending its next request when its last one ended (AIPerf's
    ``--concurrency``), until ``duration_s`` has passed; requests in flight then are waited for.
    ``bodies(i)`` gives the i-th request's (body, max_tokens). Returns (results, client CPU seconds)."""
    cpu0 = time.process_time()
    results = asyncio.run(_closed_loop(url.rstrip("/"), bodies, concurrency, duration_s, timeout))
    return results, time.process_time() - cpu0
