"""Per-request and per-token paths outside the model: the control channel's PREFILL frame of a
4,096-token prompt (encode, and decode through read_frame), incremental detokenization of
1,000 tokens, and parsing + validating an OpenAI chat request body."""

from __future__ import annotations

import asyncio
import json

import pytest

from pdkv.control import encode_frame, read_frame
from pdkv.tokenizer import Tokenizer
from pdkv.server.protocol import parse_chat

TOKENS = 4096
PREFILL = {"type": "PREFILL", "req": "cmpl-0123456789abcdef", "tokens": list(range(1000, 1000 + TOKENS)),
           "pages": list(range(7, 7 + TOKENS // 16)), "imm": 0x10002, "hidden_off": 3 * 2048,
           "expected": 256 * 8 + 1, "seed": 0x9E3779B97F4A7C15}


def decode_frame(loop, frame: bytes) -> dict:
    """read_frame over a StreamReader that already holds the frame (as the channel's reader
    would after the socket read): it completes without suspending."""
    reader = asyncio.StreamReader(loop=loop)
    reader.feed_data(frame)
    coro = read_frame(reader)
    try:
        coro.send(None)
    except StopIteration as done:
        return done.value
    raise AssertionError("read_frame suspended on a complete frame")


@pytest.fixture
def loop():
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


def test_control_prefill_encode(benchmark, budget):
    frame = benchmark(encode_frame, PREFILL)
    budget(unit="one PREFILL encoded", per_step=1, budget_pct=1, per_step_b1=1)
    assert int.from_bytes(frame[:4], "big") == len(frame) - 4
    assert decode_frame(asyncio.new_event_loop(), frame) == PREFILL


def test_control_prefill_decode(benchmark, budget, loop):
    frame = encode_frame(PREFILL)
    msg = benchmark(decode_frame, loop, frame)
    budget(unit="one PREFILL decoded", per_step=1, budget_pct=1, per_step_b1=1)
    assert msg == PREFILL  # as test_control's round trip: every field back, same types


TEXT = "Caffè, città — 日本語のテキスト 😀🚀 👍🏽 done. "  # tests/engine/test_tokenizer.py's text


@pytest.fixture(scope="module")
def tok(tiny_model_dir):
    return Tokenizer(tiny_model_dir)


def test_detokenize_1000_tokens(benchmark, budget, tok):
    ids = tok.encode(TEXT * 40)
    n = 1000
    while tok.decode(ids[:n]).endswith("\ufffd"):  # end on a whole character
        n += 1
    ids, want = ids[:n], tok.decode(ids[:n])
    prompt = tok.encode("Hello")

    def run():
        d = tok.detokenizer(prompt)
        pieces = []
        for i in ids:
            d.add(i)
            pieces.append(d.flush(finished=False))
        pieces.append(d.flush(finished=True))
        return pieces

    pieces = benchmark(run)
    # 64 running requests each add one token per decode step
    budget(unit=f"{n} tokens detokenized", per_step=64 / n, budget_pct=2, per_step_b1=1 / n)
    assert "".join(pieces) == want
    assert not any("\ufffd" in p for p in pieces)
    assert any(p == "" for p in pieces[:-1])  # some tokens end mid-character and emit nothing


CHAT = json.dumps({
    "model": "pdkv-tiny", "stream": True, "stream_options": {"include_usage": True},
    "max_completion_tokens": 256, "temperature": 0.7, "top_p": 0.95, "seed": 11, "stop": ["\n\n", "###"],
    "messages": [
        {"role": "system", "content": "You are a concise assistant."},
        {"role": "user", "content": "Summarise the design of a paged KV cache in three sentences."},
        {"role": "assistant", "content": "A paged KV cache stores keys and values in fixed-size pages."},
        {"role": "user", "content": [{"type": "text", "text": "Now the "}, {"type": "text", "text": "allocator."}]},
    ],
}).encode()


def test_openai_chat_request_validation(benchmark, budget):
    r = benchmark(lambda: parse_chat(json.loads(CHAT)))
    budget(unit="one chat request parsed and validated", per_step=1, budget_pct=1, per_step_b1=1)
    assert r.chat and r.stream and r.include_usage
    assert (r.max_tokens, r.temperature, r.top_p, r.seed, r.stop) == (256, 0.7, 0.95, 11, ["\n\n", "###"])
    assert [m["role"] for m in r.messages] == ["system", "user", "assistant", "user"]
    assert r.messages[-1]["content"] == "Now the allocator."  # content parts joined, as test_protocol
