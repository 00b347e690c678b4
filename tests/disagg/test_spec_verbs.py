"""The speculative hand-off over verbs (pdkv/disagg/spec_handoff.py): the decode node grants the
proposer's pages per request like the target's (one MR per layer and run of pages,
pdkv/disagg/grants.py) and sends their write keys with PREFILL (``spec_runs``/``spec_rkeys``);
the prefill node writes each proposer page under its range's key. Both nodes are child
processes on the loopback verbs device (tests/verbs_loopback; it checks rkey, protection domain
and MR bounds as a NIC does), so a proposer write under CONNECT's region key or outside its
range would be refused and the request would fail or draft wrongly.

- ``draft`` with the self-draft: every verification step, from the decode node's first one on,
  emits exactly k + 1 tokens (the draft KV that landed is the target's own), greedy equality;
- ``mtp``: the decode node's first drafts on P = Q + [g] (at its first step, from the MTP KV
  and o_{n-2} that landed) equal a colocated engine's on Q; greedy equality, also for waves of
  concurrent requests that fragment both pools into several runs (several keys per layer).
"""
from __future__ import annotations

import json
import threading
import urllib.request
from pathlib import Path

import pytest
import torch

from _cluster import make_engine, node_config
from _procs import NodeProc, free_port, node_dict
from pdkv.engine import LLMEngine, SamplingParams

K = 3
HERE = Path(__file__).resolve().parent


@pytest.fixture(scope="module")
def mtp_dir(tmp_path_factory):
    from pdkv.tiny_model import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("mtp"), seed=0, num_nextn_predict_layers=1)


class VerbsPair:
    def __init__(self, model_dir, tmp, env, speculative: dict, decode_script=None):
        cport = free_port()
        pre = node_dict(model_dir, "prefill", port=free_port(), control_port=cport, transport="verbs",
                        nics=["lo_verbs0"], num_pages=128)
        dec = node_dict(model_dir, "decode", port=free_port(), peers=[f"127.0.0.1:{cport}"], transport="verbs",
                        nics=["lo_verbs0"], num_pages=128)
        pre["speculative"] = dec["speculative"] = speculative
        self.pre, self.dec = NodeProc(tmp, "prefill", pre, env), NodeProc(tmp, "decode", dec, env, decode_script)
        try:
            self.pre.wait_healthy()
            self.dec.wait_healthy()
            self.name = json.loads(urllib.request.urlopen(self.dec.url + "/v1/models").read())["data"][0]["id"]
        except BaseException:
            self.stop()
            raise

    def complete(self, prompt, n):
        body = json.dumps({"model": self.name, "prompt": list(prompt), "max_tokens": n, "temperature": 0,
                           "ignore_eos": True, "return_token_ids": True}).encode()
        req = urllib.request.Request(self.dec.url + "/v1/completions", body, {"Content-Type": "application/json"})
        return json.loads(urllib.request.urlopen(req, timeout=90).read())["choices"][0]["token_ids"]

    def batch(self, prompts, n):
        got = [None] * len(prompts)
        threads = [threading.Thread(target=lambda i=i: got.__setitem__(i, self.complete(prompts[i], n)))
                   for i in range(len(prompts))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        return got

    def metric(self, name: str, label: str = "") -> float:
        """The sum of the decode node's Prometheus samples ``name`` (with ``label`` among their labels)."""
        text = urllib.request.urlopen(self.dec.url + "/metrics", timeout=10).read().decode()
        return sum(float(x.split()[-1]) for x in text.splitlines()
                   if (x.startswith(name + " ") or x.startswith(name + "{")) and label in x)

    def grants(self) -> float:
        return self.metric("pdkv_kv_grants_total")

    def spec(self) -> tuple[float, float]:
        """(verification steps with drafts, draft tokens accepted) on the decode node."""
        return (self.metric("pdkv_spec_decode_num_drafts_total"),
                self.metric("pdkv_spec_decode_num_accepted_tokens_total"))

    def idle(self) -> None:
        """Every page back on both nodes (the decode node's proposer cache's too: a leaked one
        would stay pinned and its range granted)."""
        for node in (self.pre, self.dec):
            h = node.health()
            assert h["num_pages_free"] == h["num_pages_total"], h
        assert self.dec.health()["prefill_peers"][0]["connected"]

    def stop(self):
        self.dec.stop()
        self.pre.stop()


def _prompts(seed, lengths):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 500, (n,), generator=g).tolist() for n in lengths]


@pytest.mark.slow  # node processes on the loopback verbs device: ~30 s
def test_self_draft_over_verbs_accepts_every_draft_from_the_first_step(tiny_model_dir, tmp_path, loopback_verbs_dir):
    sp = {"method": "draft", "num_tokens": K, "draft_model": {"path": str(tiny_model_dir)}}
    n, prompts = 4 * (K + 1), _prompts(11, (4, 17, 33, 60))
    plain = make_engine(node_config(tiny_model_dir, "colocated", kv_cache__num_pages=128))
    want = [o.output_token_ids for o in plain.generate(prompts, SamplingParams(max_tokens=n, temperature=0,
                                                                               ignore_eos=True))]
    pair = VerbsPair(tiny_model_dir, tmp_path, {"LD_LIBRARY_PATH": loopback_verbs_dir}, sp)
    try:
        assert [pair.complete(p, n) for p in prompts] == want
        # n tokens in n / (k + 1) steps each, every draft accepted: the first step (the held-back
        # token's) drafted from the draft KV that landed, and that KV was the target's own
        steps, accepted = pair.spec()
        assert steps == 4 * len(prompts) and accepted == K * steps, (steps, accepted)
        pair.idle()
    finally:
        pair.stop()


def _colocated_first_drafts(mtp_dir, q, n):
    """A colocated MTP engine on Q: its greedy output and its first verification (the output
    tokens it had then, the drafts)."""
    eng = LLMEngine.from_config(node_config(mtp_dir, "colocated", speculative__method="mtp",
                                            speculative__num_tokens=K, kv_cache__num_pages=128), num_threads=1)
    real, first = eng.runner.verify, []

    def verify(logits, req, drafts):
        if not first:
            first.append((len(req.output_token_ids), [int(d) for d in drafts]))
        return real(logits, req, drafts)
    eng.runner.verify = verify
    out = eng.generate([q], SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))[0].output_token_ids
    return out, first[0]


def test_mtp_over_verbs_drafts_as_colocated_from_the_first_step(mtp_dir, tmp_path, loopback_verbs_dir):
    """Prompts chunked 16 at a time; no length is 16 m + 1 (see test_spec_mtp._prompts). The
    decode node is _spec_probe_node.py: it records each request's first drafts (TEST-ONLY)."""
    sp = {"method": "mtp", "num_tokens": K}
    qs = _prompts(2, (5, 18, 30, 41))
    plain = make_engine(node_config(mtp_dir, "colocated", kv_cache__num_pages=128))
    # P = Q + [Q's greedy next token]: a colocated MTP engine on Q samples P's last token in its
    # prefill, so its first verification step is the decode node's first on P, drafts included
    firsts = [o.output_token_ids[0] for o in plain.generate(qs, SamplingParams(max_tokens=1, temperature=0))]
    ps = [q + [g] for q, g in zip(qs, firsts)]
    probe = tmp_path / "first_drafts.jsonl"
    pair = VerbsPair(mtp_dir, tmp_path, {"LD_LIBRARY_PATH": loopback_verbs_dir}, sp,
                     decode_script=(HERE / "_spec_probe_node.py", probe))
    try:
        for q, p in zip(qs, ps):
            want, (want_n, want_drafts) = _colocated_first_drafts(mtp_dir, q, 10)
            assert pair.complete(p, 9) == want[1:]
            first = {tuple(r["prompt"]): r for r in map(json.loads, probe.read_text().splitlines())}
            got = first[tuple(p)]
            assert want_n == 1 and len(want_drafts) == K
            # the decode node drafted at its very first step (no output yet), from the MTP KV and
            # o_{n-2} the prefill node wrote under the proposer ranges' keys: a colocated engine's drafts
            assert (got["num_output"], got["drafts"]) == (0, want_drafts), (got, want_drafts)
        # waves of concurrent requests, finishing in different orders, fragment the pools until
        # some request's pages form several runs (several keys per layer, for the proposer too)
        layers = plain.kv.num_layers + 1  # the target's and the MTP layer's
        waves = [_prompts(3 + w, (6, 13, 22, 35, 9)) for w in range(4)]
        want = {tuple(p): o.output_token_ids for w in waves
                for p, o in zip(w, plain.generate(w, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)))}
        done, base = 0, pair.grants()
        for w in waves:
            assert pair.batch(w, 8) == [want[tuple(p)] for p in w]
            done += len(w)
            if pair.grants() - base > (1 + layers) * done:
                break
        assert pair.grants() - base > (1 + layers) * done, "no request's pages were fragmented into several runs"
        pair.idle()
    finally:
        pair.stop()
