"""64 concurrent streaming clients: every output complete and equal to the engine's greedy output,
and the page pool back at its starting count afterwards."""

from __future__ import annotations

import asyncio

import aiohttp

from pdkv.engine import SamplingParams

NUM_CLIENTS = 64
WORDS = "fox dog page prefill decode layer cache token server batch chunk stream Paris world".split()


def prompts() -> list[str]:
    # Different lengths and contents, so prefills of several sizes share steps with decodes.
    return [" ".join(WORDS[(i + k) % len(WORDS)] for k in range(3 + i % 11)) + f" {i}" for i in range(NUM_CLIENTS)]


def test_64_concurrent_streams(api, served, reference_engine):
    served.wait_idle()
    ps = prompts()
    max_tokens = [8 + i % 9 for i in range(NUM_CLIENTS)]
    # text prompts of /v1/completions are token-healed by default (server.token_healing: auto)
    refs = reference_engine.generate(ps, [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True,
                                                         token_healing=True) for m in max_tokens])
    peak = []

    async def one(session: aiohttp.ClientSession, i: int):
        body = {"prompt": ps[i], "max_tokens": max_tokens[i], "temperature": 0, "ignore_eos": True,
                "stream": True, "return_token_ids": True}
        async with session.post(served.url + "/v1/completions", json=body) as r:
            assert r.status == 200, await r.text()
            events = await api.read_sse(r)
        peak.append(served.engine.allocator.num_used)
        return events

    async def main():
        conn = aiohttp.TCPConnector(limit=NUM_CLIENTS)
        async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=240)) as s:
            return await asyncio.gather(*(one(s, i) for i in range(NUM_CLIENTS)))

    results = asyncio.run(main())
    for i, events in enumerate(results):
        assert events[-1] == "[DONE]", f"client {i} stream did not end with [DONE]"
        chunks = events[:-1]
        ids = [t for c in chunks for t in c["choices"][0]["token_ids"]]
        text = "".join(c["choices"][0]["text"] for c in chunks)
        assert ids == refs[i].output_token_ids, f"client {i}: tokens differ from the engine's greedy output"
        assert text == refs[i].text
        assert len(ids) == max_tokens[i] and chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert max(peak) > 0
    served.wait_idle()
    assert served.engine.allocator.num_free == served.pages_at_start
