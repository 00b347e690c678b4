"""The soak's load: an open-loop arrival process of mixed requests, some of which the client
abandons on purpose.

Every request is drawn from one seeded generator: short or long prompt (token ids), streamed or
not, a small max_tokens with ``ignore_eos`` (so "complete" means exactly that many tokens), and
with probability ``abort_p`` a planned client abort -- a streamed request is dropped after a random
number of its chunks, a non-streamed one after a random delay. Arrivals are Poisson at ``rate``
and are sent on schedule whether or not earlier requests finished.

A request ends in exactly one of three ways:

    ok       all max_tokens tokens arrived (usage agrees)
    aborted  the client dropped it as planned, and nothing went wrong before that point
    failed   anything else, with a message saying what (HTTP status and the server's message, an
             SSE error event, a stream cut short, a refused connection, a timeout)
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import dataclass, field

import aiohttp


@dataclass(frozen=True)
class LoadSpec:
    rate: float = 1.0  # mean arrivals per second
    long_p: float = 0.2  # share of long prompts
    short_tokens: tuple[int, int] = (4, 48)
    long_tokens: tuple[int, int] = (200, 600)
    max_tokens: tuple[int, int] = (4, 32)
    stream_p: float = 0.5
    abort_p: float = 0.15
    timeout_s: float = 120.0
    vocab: tuple[int, int] = (3, 512)  # token ids drawn from [lo, hi): pdkv's tiny tokenizers keep 0..2 special


@dataclass(frozen=True)
class Planned:
    id: str
    at_s: float  # offset from the start of the load
    prompt: tuple[int, ...]
    max_tokens: int
    stream: bool
    abort_after_chunks: int | None = None  # streamed: drop after this many token chunks
    abort_after_s: float | None = None  # not streamed: drop after this long

    @property
    def kind(self) -> str:
        return "long" if len(self.prompt) >= 128 else "short"


@dataclass
class Outcome:
    id: str
    kind: str
    stream: bool
    planned_abort: bool
    sent_s: float
    end_s: float = 0.0
    status: str = "failed"  # ok | aborted | failed
    error: str | None = None
    http_status: int | None = None
    num_tokens: int = 0
    max_tokens: int = 0
    chunk_s: list[float] = field(default_factory=list)


def plan(spec: LoadSpec, duration_s: float, seed: int) -> list[Planned]:
    """The whole arrival schedule of a run (deterministic for a seed)."""
    rng = random.Random(f"pdkv-soak-{seed}")
    out, t, i = [], 0.0, 0
    while True:
        t += rng.expovariate(spec.rate)
        if t >= duration_s:
            return out
        lo, hi = spec.long_tokens if rng.random() < spec.long_p else spec.short_tokens
        prompt = tuple(rng.randrange(*spec.vocab) for _ in range(rng.randint(lo, hi)))
        n = rng.randint(*spec.max_tokens)
        stream = rng.random() < spec.stream_p
        chunks = delay = None
        if rng.random() < spec.abort_p:
            if stream:
                chunks = rng.randint(1, max(1, n - 1))
            else:
                delay = rng.uniform(0.01, 0.5)
        out.append(Planned(f"soak-{i}", t, prompt, n, stream, chunks, delay))
        i += 1


def _body(model: str, p: Planned) -> bytes:
    body = {"model": model, "prompt": list(p.prompt), "max_tokens": p.max_tokens, "stream": p.stream,
            "ignore_eos": True, "temperature": 0.0, "return_token_ids": True}
    if p.stream:
        body["stream_options"] = {"include_usage": True}
    return json.dumps(body, separators=(",", ":")).encode()


def _error_text(raw: bytes) -> str:
    try:
        return json.loads(raw)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return raw[:200].decode(errors="replace")


async def _stream(resp: aiohttp.ClientResponse, p: Planned, o: Outcome, t0: float) -> bool:
    """Reads the SSE stream; True when the planned abort point was reached (the caller drops it)."""
    buf, chunks = b"", 0
    async for piece in resp.content.iter_any():
        buf += piece
        *events, buf = buf.split(b"\n\n")
        for ev in events:
            for line in ev.split(b"\n"):
                if not line.startswith(b"data: "):
                    continue
                data = line[6:].strip()
                if data == b"[DONE]":
                    return False
                d = json.loads(data)
                if "error" in d:
                    e = d["error"]
                    o.error = f"error event after {o.num_tokens} of {p.max_tokens} tokens: " \
                              f"{e.get('message') if isinstance(e, dict) else e}"
                    return False
                for ch in d.get("choices") or ():
                    n = len(ch.get("token_ids") or ())
                    if n:
                        o.num_tokens += n
                        o.chunk_s.append(time.perf_counter() - t0)
                        chunks += 1
                if p.abort_after_chunks is not None and chunks >= p.abort_after_chunks:
                    return True
    o.error = o.error or f"stream ended without [DONE] after {o.num_tokens} of {p.max_tokens} tokens"
    return False


async def _send(session: aiohttp.ClientSession, url: str, model: str, p: Planned, o: Outcome, t0: float,
                timeout: float) -> None:
    async with session.post(url + "/v1/completions", data=_body(model, p),
                            headers={"Content-Type": "application/json"},
                            timeout=aiohttp.ClientTimeout(total=timeout)) as resp:
        o.http_status = resp.status
        if resp.status != 200:
            o.error = f"HTTP {resp.status}: {_error_text(await resp.read())}"
            return
        if p.stream:
            if await _stream(resp, p, o, t0):
                resp.close()  # the planned abort: drop the connection mid-stream
                o.status = "aborted"
            return
        d = json.loads(await resp.read())
        o.num_tokens = int((d.get("usage") or {}).get("completion_tokens") or 0)


async def one(session: aiohttp.ClientSession, url: str, model: str, p: Planned, t0: float,
              timeout: float) -> Outcome:
    """Sends ``p`` at its offset from ``t0`` (time.perf_counter) and says how it ended."""
    now = time.perf_counter() - t0
    if p.at_s > now:
        await asyncio.sleep(p.at_s - now)
    o = Outcome(p.id, p.kind, p.stream, p.abort_after_chunks is not None or p.abort_after_s is not None,
                time.perf_counter() - t0, max_tokens=p.max_tokens)
    try:
        if p.abort_after_s is not None:
            try:
                await asyncio.wait_for(_send(session, url, model, p, o, t0, timeout), p.abort_after_s)
            except asyncio.TimeoutError:
                if o.error is None:
                    o.status = "aborted"
        else:
            await _send(session, url, model, p, o, t0, timeout)
    except asyncio.TimeoutError:
        o.error = f"no complete answer within {timeout:g} s ({o.num_tokens} of {p.max_tokens} tokens)"
    except aiohttp.ClientConnectorError as e:
        o.error = f"cannot connect to {url}: {e.os_error.strerror if e.os_error else e}"
    except (aiohttp.ClientError, ConnectionError) as e:
        o.error = f"connection lost after {o.num_tokens} of {p.max_tokens} tokens ({type(e).__name__}: {e})"
    except ValueError as e:
        o.error = f"not JSON from the server: {e}"
    o.end_s = time.perf_counter() - t0
    if o.status == "aborted" or o.error is not None:
        return o
    if o.num_tokens != p.max_tokens:
        o.error = f"got {o.num_tokens} tokens, asked for exactly {p.max_tokens} (ignore_eos)"
    else:
        o.status = "ok"
    return o


async def run_load(url: str, model: str, planned: list[Planned], t0: float, timeout: float,
                   on_done=None) -> list[Outcome]:
    """Every planned request, open-loop, against ``url``."""
    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=conn) as session:
        async def run(p):
            o = await one(session, url, model, p, t0, timeout)
            if on_done is not None:
                on_done(o)
            return o

        return list(await asyncio.gather(*(run(p) for p in planned)))
