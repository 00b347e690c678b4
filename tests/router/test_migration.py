"""Request migration: a decode/colocated node killed -9 while 8 greedy streams run through the
router; every client stream completes with exactly the tokens (and text) of an undisturbed run,
token by token, with no error event; the router counts the migrations."""

from __future__ import annotations

import asyncio
import json
import signal
import time
import urllib.request

import aiohttp

from pdkv.ports import free_port
from pdkv.router import RouterThread



def _start_node_process(model_dir, port, log_path):
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location("_failover", Path(__file__).with_name("test_router_failover.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod._start_node_process(model_dir, port, log_path)

GREEDY = {"temperature": 0, "max_tokens": 160, "ignore_eos": True, "stream": True}


async def _stream(s: aiohttp.ClientSession, url: str, body: dict, on_first=None):
    """(node, text, token ids or None, events) of one streamed completion."""
    async with s.post(url + "/v1/completions", json=body) as r:
        assert r.status == 200, await r.text()
        node, text, ids, events = r.headers.get("X-Pdkv-Node"), [], [], []
        async for line in r.content:
            if not line.startswith(b"data: "):
                continue
            d = line[6:].strip()
            events.append(d)
            if d == b"[DONE]":
                continue
            msg = json.loads(d)
            assert "error" not in msg, msg
            for ch in msg["choices"]:
                text.append(ch["text"])
                if "token_ids" in ch:
                    ids.extend(ch["token_ids"])
            if on_first is not None and node is not None:
                on_first(node)
        return node, "".join(text), ids if body.get("return_token_ids") else None, events


def test_streams_continue_exactly_after_kill9(rt, nodes, router_model_dir, tmp_path):
    port = free_port()
    victim_url = f"http://127.0.0.1:{port}"
    proc = _start_node_process(router_model_dir, port, tmp_path / "victim.log")
    prompts = [f"storia {i} di un gatto" for i in range(8)]
    try:
        async def reference():
            async with aiohttp.ClientSession() as s:
                return await asyncio.gather(*(_stream(s, nodes[0].url, {"prompt": p, **GREEDY, "return_token_ids": True})
                                              for p in prompts))
        want = rt.run(reference())
        urls = [victim_url, nodes[1].url]
        with RouterThread(rt.router_cfg(urls, "policy=round_robin")) as router:
            async def run_and_kill():
                victim_streaming = asyncio.Event()
                async with aiohttp.ClientSession() as s:
                    seen = lambda node: node == victim_url and victim_streaming.set()  # noqa: E731
                    # half the clients ask for token ids themselves (they must get them unchanged)
                    tasks = [asyncio.create_task(_stream(s, router.url, {"prompt": p, **GREEDY,
                                                                         "return_token_ids": i % 2 == 0}, seen))
                             for i, p in enumerate(prompts)]
                    await asyncio.wait_for(victim_streaming.wait(), 60)
                    await asyncio.sleep(0.05)  # a few tokens in
                    proc.send_signal(signal.SIGKILL)
                    return await asyncio.gather(*tasks)
            t0 = time.monotonic()
            got = rt.run(run_and_kill())
            took = time.monotonic() - t0
            metrics = urllib.request.urlopen(router.url + "/metrics").read().decode()
        on_victim = [g for g in got if g[0] == victim_url]
        assert on_victim, "no stream ran on the killed node"
        for i, ((node, text, ids, events), (_, want_text, want_ids, _)) in enumerate(zip(got, want)):
            assert events[-1] == b"[DONE]", (i, node, events[-3:])
            if ids is not None:
                assert ids == want_ids, (i, node, next(j for j, (a, b) in enumerate(zip(ids, want_ids)) if a != b))
            # the text too, character by character: one whose bytes the failure split between
            # two tokens is carried by the new node's detokenizer (this random model emits many)
            at = next((j for j, (a, b) in enumerate(zip(text, want_text)) if a != b), min(len(text), len(want_text)))
            assert text == want_text, (i, node, at, text[max(0, at - 8):at + 8], want_text[max(0, at - 8):at + 8])
        migrated = sum(float(line.split()[-1]) for line in metrics.splitlines()
                       if line.startswith("pdkv_router_migrations_total{") and 'result="ok"' in line)
        # a stream the victim finished before it died needed no move: at least one did
        assert 1 <= migrated <= len(on_victim), [m for m in metrics.splitlines() if "migrations" in m]
        print(f"migration: {len(on_victim)} stream(s) on the killed node, all 8 token-exact, {took:.2f} s")
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()


def test_a_node_resumes_a_stream_exactly(rt, nodes):
    """pdkv_resume on a node: the rest of a greedy stream, the held-back text first; bad resumes
    are a 400 naming the field."""
    url = nodes[2].url
    body = {"prompt": "una storia breve", **GREEDY, "max_tokens": 24, "return_token_ids": True}

    async def main():
        async with aiohttp.ClientSession() as s:
            _, text, ids, _ = await _stream(s, url, body)
            k = 9
            async with s.post(url + "/v1/completions", json={**body, "stream": False, "max_tokens": k}) as r:
                head = await r.json()
            head_text = head["choices"][0]["text"]
            assert text.startswith(head_text) and head["choices"][0]["token_ids"] == ids[:k]
            held = 2 if len(head_text) >= 2 else 0  # as if a stop string's possible start was held back
            resume = {"token_ids": ids[:k], "text_chars": len(head_text) - held,
                      "prompt_token_ids": head["prompt_token_ids"][0]}  # healed: the prompt the node ran
            _, rest, rest_ids, _ = await _stream(s, url, {**body, "pdkv_resume": resume})
            bad = []
            for extra in ({"n": 2}, {"echo": True}, {"max_tokens": k}):
                async with s.post(url + "/v1/completions", json={**body, **extra, "pdkv_resume": resume}) as r:
                    bad.append((r.status, (await r.json())["error"]["message"]))
            return text, ids, head_text, held, rest, rest_ids, k, bad
    text, ids, head_text, held, rest, rest_ids, k, bad = rt.run(main())
    # the prompt was healed (a text prompt): the resume runs from the healed prompt the first
    # node reported, so the tokens go on exactly, and the held-back text comes first
    assert rest_ids == ids[k:], (rest_ids, ids)
    assert head_text[:len(head_text) - held] + rest == text, (head_text, held, rest, text)
    assert all(st == 400 and "pdkv_resume" in msg for st, msg in bad), bad


async def _chunks(s: aiohttp.ClientSession, url: str, body: dict):
    """Per SSE chunk of a streamed completion: (token ids, text, finish_reason); and the prompt
    token ids the node ran."""
    out, prompt = [], None
    async with s.post(url + "/v1/completions", json={**body, "stream": True, "return_token_ids": True}) as r:
        assert r.status == 200, await r.text()
        async for line in r.content:
            d = line.strip()[6:] if line.startswith(b"data: ") else b""
            if not d or d == b"[DONE]":
                continue
            msg = json.loads(d)
            assert "error" not in msg, msg
            for ch in msg["choices"]:
                prompt = prompt or ch.get("prompt_token_ids")
                out.append((ch.get("token_ids") or [], ch["text"], ch.get("finish_reason")))
    return out, prompt


async def _cut_and_resume(s, url, body, chunks, prompt, cut):
    """The stream broken after chunk ``cut`` (the client has its text, exactly as the router
    counts it), resumed on ``url``: what the client sees in all, chunk by chunk."""
    head = chunks[:cut + 1]
    ids = [t for c in head for t in c[0]]
    resume = {"token_ids": ids, "text_chars": sum(len(c[1]) for c in head), "prompt_token_ids": prompt}
    rest, _ = await _chunks(s, url, {**body, "pdkv_resume": resume})
    return head + rest


def _same(got, want):
    """Token by token and character by character, and the same ending."""
    ids = [t for c in got for t in c[0]]
    want_ids = [t for c in want for t in c[0]]
    assert ids == want_ids, next(j for j, (a, b) in enumerate(zip(ids + [None], want_ids + [None])) if a != b)
    assert "".join(c[1] for c in got) == "".join(c[1] for c in want)
    assert [c[2] for c in got if c[2]] == [c[2] for c in want if c[2]]


def test_resume_carries_seed_stop_strings_split_characters_and_structured_output(rt, nodes):
    """pdkv_resume on another node, cut after every few chunks: a seeded sampled stream, a stop
    string spanning the cut, a character whose bytes the cut split and a structured-output
    stream each continue exactly as the undisturbed run (token by token)."""
    a, b = nodes[0].url, nodes[1].url  # the stream begins on a and is resumed on b
    base = {"prompt": "la storia di un gatto", "max_tokens": 40, "ignore_eos": True}
    seeded = {**base, "temperature": 1.0, "top_p": 0.95, "seed": 1234, "frequency_penalty": 0.5}

    async def main():
        async with aiohttp.ClientSession() as s:
            seen = {"cuts": 0}

            async def check(body, cuts):
                want, prompt = await _chunks(s, a, body)
                for cut in cuts:
                    _same(await _cut_and_resume(s, b, body, want, prompt, cut), want)
                    seen["cuts"] += 1
                return want

            # a seeded, sampled stream (penalties over the output too), cut at several points
            plain = await check(seeded, [0, 3, 11, 25])
            # a stop string that spans the cut: the stopped run is cut one chunk before its end,
            # while it holds back text that might begin the stop string (carried to the new node)
            full = "".join(c[1] for c in plain)
            n = len(full) // 2
            while n < len(full) - 4 and not (full[n - 2:n + 2].isascii() and full[n - 2:n + 2].strip()):
                n += 1
            stop = full[n - 2:n + 2]
            assert full.find(stop) == n - 2, "the stop string occurs earlier"
            stopped, sp = await _chunks(s, a, {**seeded, "stop": [stop]})
            assert stopped[-1][2] == "stop" and "".join(c[1] for c in stopped) == full[:n - 2]
            k = max(j for j, c in enumerate(stopped[:-1]) if c[0])
            assert "".join(c[1] for c in stopped[k + 1:]), "nothing held back at the cut"
            _same(await _cut_and_resume(s, b, {**seeded, "stop": [stop]}, stopped, sp, k), stopped)
            # a character split between tokens: a chunk whose token's text is still incomplete
            greedy = {**base, "temperature": 0, "max_tokens": 80}
            g, gp = await _chunks(s, a, greedy)
            split = [j for j, c in enumerate(g[:-1]) if c[0] and not c[1] and not g[j + 1][1].isascii()]
            assert split, "no split character in this run: pick another prompt"
            _same(await _cut_and_resume(s, b, greedy, g, gp, split[0]), g)
            # structured output, sampled and seeded: the matcher goes on where it was
            # (not ignore_eos: a grammar that completed accepts EOS and must end there)
            regex = {**seeded, "ignore_eos": False, "guided_regex": "(ab|c[de]+|[0-9]{2,3} )+", "max_tokens": 30}
            await check(regex, [2, 9])
            # tokens that do not follow the grammar are refused, naming the field
            async with s.post(b + "/v1/completions", json={**regex, "stream": True, "pdkv_resume": {
                    "token_ids": [t for c in plain[:4] for t in c[0]], "text_chars": 0}}) as r:
                bad = (r.status, (await r.json())["error"]["message"])
            return seen["cuts"], bad
    cuts, bad = rt.run(main())
    assert cuts == 6
    assert bad[0] == 400 and "pdkv_resume" in bad[1] and "structured output" in bad[1], bad


def _chat_view(events: list[bytes]) -> tuple[str, str, list[int]]:
    """(reasoning_content, content, token ids) of a chat stream's SSE events as a client sees them."""
    reasoning, content, ids = "", "", []
    for e in events:
        d = e.strip()[6:] if e.strip().startswith(b"data: ") else b""
        if not d or d == b"[DONE]":
            continue
        msg = json.loads(d)
        assert "error" not in msg, msg
        for ch in msg["choices"]:
            reasoning += ch["delta"].get("reasoning_content") or ""
            content += ch["delta"].get("content") or ""
            ids += ch.get("token_ids") or []
    return reasoning, content, ids


async def _raw_events(s, url, body) -> list[bytes]:
    async with s.post(url + "/v1/chat/completions", json=body) as r:
        assert r.status == 200, await r.text()
        return [e + b"\n\n" for e in (await r.read()).split(b"\n\n") if e.strip()]


def test_resume_carries_a_chat_reasoning_parsers_state(rt, router_model_dir):
    """Chat with a reasoning parser: the router's StreamState cuts a stream (every output of
    this model is reasoning under deepseek_r1, whose deltas drop the tags) and the node resumes
    it: reasoning and content equal the undisturbed run's; under qwen3, resumed tokens that
    opened a think block leave the new node's parser inside it."""
    from pdkv.router.migrate import StreamState

    r1 = rt.Node(router_model_dir, 0, "server.reasoning_parser=deepseek_r1")
    q3 = rt.Node(router_model_dir, 0, "server.reasoning_parser=qwen3")
    body = {"messages": [{"role": "user", "content": "raccontami"}], "max_tokens": 30, "temperature": 1.0,
            "seed": 99, "ignore_eos": True, "stream": True}
    try:
        async def main():
            async with aiohttp.ClientSession() as s:
                want = await _raw_events(s, r1.url, {**body, "return_token_ids": True})
                results = []
                for cut in (3, 9, 20):
                    st = StreamState(chat=True, client_token_ids=True)
                    head = st.feed(b"".join(want[:cut]), False)  # what the client had at the break
                    rest = st.feed(b"".join(await _raw_events(s, r1.url, st.resume_body(body))), True)
                    results.append((cut, st.text_chars, head + rest))
                # qwen3: the first node's output opened a think block just before the break
                tok = q3.engine.tokenizer
                opened = tok.encode("<think>\nhmm", add_special_tokens=False)
                resume = {"token_ids": opened, "text_chars": len(tok.decode(opened))}
                inside = await _raw_events(s, q3.url, {**body, "return_token_ids": True, "pdkv_resume": resume})
                return want, results, inside
        want, results, inside = rt.run(main())
        wr, wc, wids = _chat_view(want)
        assert wr and not wc  # deepseek_r1: everything this model says is reasoning
        for cut, chars, got in results:
            gr, gc, gids = _chat_view(got.split(b"\n\n"))
            assert chars > 0 and gids == wids and (gr, gc) == (wr, wc), (cut, chars, gr[:40], wr[:40])
        ir, ic, _ = _chat_view(inside)
        assert ir and not ic, (ir[:40], ic[:40])  # the parser is in the think block it was in
    finally:
        r1.stop()
        q3.stop()
