"""A server with speculative decoding (``--set speculative.method=ngram``): the stream carries
several tokens per chunk when drafts are accepted, its text is what the reference engine gives,
and /metrics reports the spec_decode counters and histogram."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def spec_served(api, server_model_dir):
    s = api.Served(api.make_config(server_model_dir, "speculative.method=ngram", "speculative.num_tokens=3"))
    yield s
    s.close()


def test_stream_and_metrics_with_ngram(api, spec_served, reference_engine):
    from pdkv.engine import SamplingParams

    s = spec_served
    s.wait_idle()
    itl = "pdkv_inter_token_latency_seconds"
    itl_before = (api.metric(s.url, itl + "_count"), api.metric(s.url, itl + "_bucket", le="0.001"))
    prompt = "Hello"
    body = {"prompt": prompt, "max_tokens": 60, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
    chunks = api.stream(s.url, "/v1/completions", body)
    ids = [t for c in chunks[:-1] for t in c["choices"][0].get("token_ids") or []]
    want = reference_engine.generate([prompt], SamplingParams(max_tokens=60, temperature=0, ignore_eos=True))[0]
    assert ids == want.output_token_ids
    assert "".join(c["choices"][0]["text"] for c in chunks[:-1]) == want.text
    sizes = [len(c["choices"][0].get("token_ids") or []) for c in chunks[:-1]]
    assert max(sizes) >= 2
    s.wait_idle()
    # Per-token ITL: 59 gaps for 60 tokens; each multi-token chunk's tokens after its first are 0 gaps.
    assert api.metric(s.url, itl + "_count") - itl_before[0] == 60 - 1
    assert api.metric(s.url, itl + "_bucket", le="0.001") - itl_before[1] >= sum(n - 1 for n in sizes if n)
    drafts = api.metric(s.url, "pdkv_spec_decode_num_draft_tokens_total")
    accepted = api.metric(s.url, "pdkv_spec_decode_num_accepted_tokens_total")
    steps = api.metric(s.url, "pdkv_spec_decode_num_drafts_total")
    st = s.engine.stats()
    assert (drafts, accepted, steps) == (st["spec_num_draft_tokens"], st["spec_num_accepted_tokens"],
                                         st["spec_num_drafts"])
    assert 0 < accepted < drafts
    assert api.metric(s.url, "pdkv_spec_decode_num_accepted_tokens_per_pos_total", position="0") == \
        st["spec_num_accepted_tokens_per_pos"][0]
    assert api.metric(s.url, "pdkv_spec_decode_accepted_length_count") == steps
    assert api.metric(s.url, "pdkv_spec_decode_accepted_length_sum") == steps + accepted
    # The counters against each other, not only against the engine's copy of themselves: every
    # accepted token was accepted at one position (summed over the positions, the label absent:
    # the three of them), and the histogram of emitted lengths adds up to the same tokens.
    per_pos = [api.metric(s.url, "pdkv_spec_decode_num_accepted_tokens_per_pos_total", position=str(i))
               for i in range(3)]
    assert sum(per_pos) == accepted and per_pos == sorted(per_pos, reverse=True), per_pos
    assert api.metric(s.url, "pdkv_spec_decode_num_accepted_tokens_per_pos_total") == accepted
    lengths = st["spec_accepted_length_counts"]
    assert sum(j * c for j, c in enumerate(lengths)) == steps + accepted and sum(lengths) == steps


def test_client_disconnect_mid_speculation_frees_every_page(api, spec_served):
    import asyncio

    import aiohttp

    s = spec_served
    s.wait_idle()
    body = {"prompt": "Hello", "max_tokens": 400, "temperature": 0, "ignore_eos": True, "stream": True}
    held = []

    async def client():
        async with aiohttp.ClientSession() as sess:
            resp = await sess.post(s.url + "/v1/completions", json=body)
            assert resp.status == 200
            n = 0
            async for line in resp.content:
                if line.startswith(b"data: "):
                    n += 1
                    if n == 6:
                        break
            held.append(s.engine.allocator.num_used)
            resp.close()  # a killed client, while drafts are being verified

    asyncio.run(client())
    assert held[0] > 0
    s.wait_idle()  # every page back, no unfinished request
    assert api.metric(s.url, "pdkv_spec_decode_num_drafts_total") > 0


def test_itl_counts_every_token_of_a_delta_and_the_gap_once():
    """The ITL histogram's accounting of multi-token deltas (server/metrics.py
    ``tokens_delivered``): the first delta's extra tokens are 0 gaps, a later delta of m tokens
    after a gap g is g once and m - 1 zeros (smearing g / m over m tokens, as before, hid a
    stalled step: here a 0.2 s gap would have shown as four 0.05 s ones)."""
    from pdkv.server.metrics import ServerMetrics

    m = ServerMetrics("m")

    def sample(suffix, **labels):
        return m.registry.get_sample_value("pdkv_inter_token_latency_seconds" + suffix,
                                           {"model_name": "m", **labels})

    m.tokens_delivered(None, 3)  # the first delta: TTFT's, plus two tokens that came with it
    assert (sample("_count"), sample("_sum")) == (2, 0.0)
    m.tokens_delivered(0.2, 4)  # a verification step that kept 3 drafts + the target's token
    m.tokens_delivered(0.01, 1)
    assert sample("_count") == 7 and abs(sample("_sum") - 0.21) < 1e-12
    assert sample("_bucket", le="0.001") == 5  # 2 + 3 zeros
    assert sample("_bucket", le="0.1") == 6 and sample("_bucket", le="0.2") == 7
    m.tokens_delivered(0.5, 0)  # an empty delta (a finish without tokens) counts nothing
    assert sample("_count") == 7
