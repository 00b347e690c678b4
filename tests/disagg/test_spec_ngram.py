"""ngram speculative decoding on a disaggregated decode node (tcp): the node drafts from its very
first decode step (the held-back last prompt token) with nothing from the prefill node, and
greedy output is token for token what a colocated engine without speculation gives: a batch of
prompts of different lengths, EOS / a stop string / a stop token / max_tokens inside an accepted
run, prefill TP2 -> decode TP1. Aborts in the middle of a verification step and clients that
leave mid-stream give every page back on both nodes."""
from __future__ import annotations

import asyncio
import json
import shutil
import threading
import urllib.request

import aiohttp
import pytest
import torch

from _cluster import Cluster, make_engine, node_config, post_completion, wait_for
from pdkv.engine import SamplingParams

K = 4
NGRAM = {"speculative__method": "ngram", "speculative__num_tokens": K}
KV = {"kv_cache__num_pages": 256}


def _greedy(n, **kw):
    return SamplingParams(max_tokens=n, temperature=0, ignore_eos=kw.pop("ignore_eos", True), **kw)


def _prompts():
    g = torch.Generator().manual_seed(3)
    return [torch.randint(0, 500, (n,), generator=g).tolist() for n in (2, 11, 26, 40, 75)]


@pytest.fixture(scope="module")
def plain(tiny_model_dir):
    return make_engine(node_config(tiny_model_dir, "colocated", **KV))


@pytest.fixture(scope="module")
def looping(plain):
    """A prompt whose greedy continuation repeats a span of the prompt itself (prompt lookup
    predicts it): P + O[:m], O being P's greedy output where it already loops. (prompt, cont)."""
    p = plain.tokenizer.encode("Hello")
    out = plain.generate([p], _greedy(160))[0].output_token_ids
    for m in range(8, 140):
        cont = out[m:]
        if any(out[i:i + 12] == cont[:12] for i in range(m - 12)) and len(set(cont[:3])) == 3:
            return p + out[:m], cont
    raise AssertionError(f"the tiny model's output does not loop: {out}")


class Verifications:
    """Observes the decode engine's verification steps (runner.verify): per request, how many
    output tokens it had at each one (0: its first decode step verified drafts)."""

    def __init__(self, engine):
        self.engine, self.real = engine, engine.runner.verify
        self.seen: dict[str, list[int]] = {}
        engine.runner.verify = self

    def __call__(self, logits, req, drafts):
        self.seen.setdefault(req.request_id, []).append(len(req.output_token_ids))
        return self.real(logits, req, drafts)

    def restore(self):
        self.engine.runner.verify = self.real


def _cluster(model_dir, **prefill_over):
    c = Cluster(model_dir, prefill_over={**KV, **prefill_over}, decode_over={**KV, **NGRAM})
    assert c.decode_engine.spec is not None and c.prefill_engine.spec is None
    return c


@pytest.fixture(scope="module")
def cluster(tiny_model_dir):
    c = _cluster(tiny_model_dir)
    yield c
    c.stop()


def _complete(url, prompt, params: SamplingParams, **extra):
    name = json.loads(urllib.request.urlopen(url + "/v1/models").read())["data"][0]["id"]
    body = {"model": name, "prompt": list(prompt), "max_tokens": params.max_tokens, "temperature": 0,
            "ignore_eos": params.ignore_eos, "return_token_ids": True, **extra}
    status, out = post_completion(url, body, timeout=120)
    assert status == 200, out
    return out["choices"][0]


def _spec_counts(engine):
    s = engine.spec.stats
    return s.num_drafts, s.num_accepted_tokens


def _batch(url, prompts, n):
    """All prompts at once (one thread each): token ids per prompt."""
    got = [None] * len(prompts)

    def run(i):
        got[i] = _complete(url, prompts[i], _greedy(n))["token_ids"]
    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(180)
    return got


def test_batch_equals_colocated_without_speculation(cluster, plain, looping):
    prompts = _prompts() + [looping[0]]
    want = [o.output_token_ids for o in plain.generate(prompts, _greedy(24))]
    v = Verifications(cluster.decode_engine)
    before = _spec_counts(cluster.decode_engine)
    try:
        got = _batch(cluster.url, prompts, 24)
    finally:
        v.restore()
    assert got == want
    drafts, accepted = (a - b for a, b in zip(_spec_counts(cluster.decode_engine), before))
    assert accepted > 20 and drafts > 0
    # The looping prompt's first decode step (its held-back last prompt token) verified drafts
    # made from the prompt alone: nothing was prefilled on the decode node.
    assert 0 in [lens[0] for lens in v.seen.values()]
    wait_for(cluster.pools_full, 10, "every page back on both nodes")


@pytest.mark.parametrize("end", ["max_tokens", "stop_token", "stop_string", "eos"])
def test_run_ends_at_the_right_token(tiny_model_dir, tmp_path, cluster, plain, looping, end):
    prompt, cont = looping
    j = 2  # end on the 3rd output token: an accepted draft of the very first verification step
    assert cont[j] not in cont[:j]
    extra, c, ref = {}, cluster, plain
    if end == "max_tokens":
        params = _greedy(j + 1)
    elif end == "stop_token":
        params = _greedy(64)
        extra = {"stop_token_ids": [cont[j]]}
    elif end == "stop_string":
        text = plain.tokenizer.decode(cont[:j + 1])
        stop = text[len(plain.tokenizer.decode(cont[:j])):]  # what the (j+1)-th token adds
        assert stop and stop not in plain.tokenizer.decode(cont[:j])
        params = _greedy(64)
        extra = {"stop": [stop]}
    else:  # the model folder (both nodes') declares cont[j] an EOS token
        path = tmp_path / "m"
        shutil.copytree(tiny_model_dir, path)
        gen = json.loads((path / "generation_config.json").read_text())
        gen["eos_token_id"] = [cont[j]]
        (path / "generation_config.json").write_text(json.dumps(gen))
        params = _greedy(64, ignore_eos=False)
        c, ref = _cluster(path), make_engine(node_config(path, "colocated", **KV))
    try:
        want = ref.generate([prompt], SamplingParams(max_tokens=params.max_tokens, temperature=0,
                                                     ignore_eos=params.ignore_eos, stop=extra.get("stop", []),
                                                     stop_token_ids=extra.get("stop_token_ids", [])))[0]
        v = Verifications(c.decode_engine)
        before = _spec_counts(c.decode_engine)
        try:
            got = _complete(c.url, prompt, params, **extra)
        finally:
            v.restore()
        assert got["token_ids"] == want.output_token_ids == cont[:j + 1]
        assert (got["text"], got["finish_reason"]) == (want.text, want.finish_reason)
        assert got["finish_reason"] == ("length" if end == "max_tokens" else "stop")
        # the whole answer came out of the first decode step: one verification, two accepted drafts
        (lens,) = v.seen.values()
        drafts, accepted = (a - b for a, b in zip(_spec_counts(c.decode_engine), before))
        assert lens == [0] and drafts == 1 and accepted >= j, (lens, drafts, accepted)
        wait_for(c.pools_full, 10, "every page back on both nodes")
    finally:
        if c is not cluster:
            c.stop()


def test_abort_mid_verification_and_client_gone_free_every_page(cluster, looping):
    eng, prompt = cluster.decode_engine, looping[0]
    # Fault injection on the engine thread: right after the scheduler grew a request's pages for
    # the drafts of its first verification step, the request is aborted (as a client that left
    # would be) and the step runs without it.
    schedule, aborted = eng.scheduler.schedule, []

    def abort_first_verifier():
        out = schedule()
        for s in list(out.seqs):
            if s.num_draft and not aborted:
                aborted.append(s.request.request_id)
                eng.abort(s.request.request_id)
                out.seqs.remove(s)
                eng.scheduler.schedule = schedule
        return out
    eng.scheduler.schedule = abort_first_verifier
    try:
        status, body = post_completion(cluster.url, {"model": cluster.model_name(), "prompt": prompt,
                                                     "max_tokens": 40, "temperature": 0, "ignore_eos": True})
    finally:
        eng.scheduler.schedule = schedule
    assert aborted and (status != 200 or body["choices"][0]["finish_reason"] == "abort"), (status, body)
    wait_for(cluster.pools_full, 10, "every page back after the abort mid-verification")

    # A streaming client that leaves after two deltas: the request is verifying drafts then.
    before = _spec_counts(eng)

    async def client():
        async with aiohttp.ClientSession() as s:
            resp = await s.post(cluster.url + "/v1/completions",
                                json={"model": cluster.model_name(), "prompt": prompt, "max_tokens": 200,
                                      "temperature": 0, "ignore_eos": True, "stream": True})
            assert resp.status == 200
            n = 0
            async for line in resp.content:
                if line.startswith(b"data: "):
                    n += 1
                    if n == 2:
                        break
            resp.close()
    asyncio.run(client())
    wait_for(lambda: not eng.has_unfinished() and cluster.pools_full(), 20, "every page back after the client left")
    drafts, accepted = (a - b for a, b in zip(_spec_counts(eng), before))
    assert 0 < drafts and accepted < 200


def test_tp2_prefill_to_tp1_decode_equals_colocated(tiny_model_dir, plain, looping):
    from _tp_pair import TP2ToTP1

    pair = TP2ToTP1(tiny_model_dir, KV, {**KV, **NGRAM})
    try:
        prompts = _prompts()[1:] + [looping[0]]
        want = [o.output_token_ids for o in plain.generate(prompts, _greedy(16))]
        assert _batch(pair.url, prompts, 16) == want
        assert pair.decode_engine.spec.stats.num_accepted_tokens > 10
        wait_for(pair.pools_full, 10, "every page back on both nodes")
    finally:
        pair.stop()
