"""The handshake compares the speculative hand-off (what the prefill node prepares for the decode
node's proposer: method, num_tokens, MTP layers, draft model) field by field and refuses a peer
that differs, naming each field; ngram needs nothing from the prefill node and is no part of it."""
from __future__ import annotations

import asyncio
import dataclasses
import shutil
from types import SimpleNamespace

import pytest

from _cluster import Cluster
from pdkv.config import DraftModelConfig, SpeculativeConfig
from pdkv.control import ControlChannel, Hello, HandshakeRefused
from pdkv.disagg.protocol import spec_handoff
from pdkv.server.app import NODE


def _hello(role, spec):
    return Hello(node_id=1, role=role, model_fingerprint="f", dtype="float32", kv_layout="HND", page_size=4,
                 speculative=spec)


def _engine_of(path, mtp_layers=0):
    return SimpleNamespace(loaded=SimpleNamespace(path=path, arch=SimpleNamespace(num_nextn_predict_layers=mtp_layers)))


def test_differences_name_every_speculative_field():
    mtp = {"method": "mtp", "num_tokens": 3, "mtp_layers": 1}
    assert _hello("decode", mtp).differences(_hello("prefill", dict(mtp))) == []
    assert _hello("decode", {}).differences(_hello("prefill", {})) == []
    got = _hello("decode", mtp).differences(_hello("prefill", {**mtp, "num_tokens": 4, "mtp_layers": 2}))
    assert got == ["speculative.num_tokens: this decode node has 3, the prefill node has 4",
                   "speculative.mtp_layers: this decode node has 1, the prefill node has 2"]
    draft = {"method": "draft", "num_tokens": 3, "draft_model": "abc"}
    got = _hello("prefill", {}).differences(_hello("decode", draft))
    assert got == ["speculative.method: this prefill node has None, the decode node has 'draft'",
                   "speculative.num_tokens: this prefill node has None, the decode node has 3",
                   "speculative.draft_model: this prefill node has None, the decode node has 'abc'"]
    assert _hello("prefill", {}).differences(_hello("decode", 5)) == ["speculative: the decode node sent 5 (not a map)"]


def test_handoff_of_each_method(tiny_model_dir, tmp_path):
    eng = _engine_of(tiny_model_dir, mtp_layers=1)
    assert spec_handoff(None, eng) == {} == spec_handoff(SpeculativeConfig(), eng)
    assert spec_handoff(SpeculativeConfig(method="ngram", num_tokens=5), eng) == {}  # nothing from prefill
    assert spec_handoff(SpeculativeConfig(method="mtp", num_tokens=2), eng) == \
        {"method": "mtp", "num_tokens": 2, "mtp_layers": 1}
    # the draft model is identified by its config and tensor shapes, not by where it lies
    copy = tmp_path / "elsewhere"
    shutil.copytree(tiny_model_dir, copy)
    from pdkv.tiny_model import make_tiny_model

    other = make_tiny_model(tmp_path / "other", hidden_size=32, seed=1)
    fp = [spec_handoff(SpeculativeConfig(method="draft", num_tokens=3, draft_model=DraftModelConfig(str(p))),
                       eng)["draft_model"] for p in (tiny_model_dir, copy, other)]
    assert fp[0] == fp[1] != fp[2]


def test_prefill_node_refuses_a_decode_node_with_another_handoff(tiny_model_dir):
    """A real prefill node without speculation and a decode HELLO asking for the MTP hand-off:
    both ends refuse, naming the fields; a decode node running ngram is served."""
    c = Cluster(tiny_model_dir, decode_over={"speculative__method": "ngram"})
    try:
        assert c.coordinator.hello.speculative == {} == c.prefill.app[NODE].coordinator.hello.speculative
        good = c.coordinator.hello
        bad = dataclasses.replace(good, speculative={"method": "mtp", "num_tokens": 4, "mtp_layers": 1})
        port = c.prefill.app[NODE].control_port

        async def dial():
            ch = await ControlChannel.connect("127.0.0.1", port, bad, 10.0)
            ch.close()

        with pytest.raises(HandshakeRefused) as e:
            asyncio.run(dial())
        msg = str(e.value)
        for want in ("speculative.method: this decode node has 'mtp', the prefill node has None",
                     "speculative.num_tokens: this decode node has 4, the prefill node has None",
                     "speculative.mtp_layers: this decode node has 1, the prefill node has None"):
            assert want in msg, msg
        # the prefill node still serves the decode node whose hand-off matches (none, with ngram)
        from _cluster import assert_colocated_answer

        assert_colocated_answer(c.url, c.model_name(), tiny_model_dir, list(range(3, 20)), 5)
    finally:
        c.stop()
