"""Disaggregated serving of the MoE / MLA families equals colocated serving: greedy tokens through
prefill TP2 -> decode TP1, TP1 -> TP2 and TP2 -> TP2 (tcp, real nodes on loopback) equal a
colocated TP1 engine's for DeepSeek-V3 (the replicated latent: every decode rank receives whole
latent pages from one seeded source rank) and for Qwen3-MoE (GQA heads split one per rank);
and over the loopback verbs device (``pdkv serve`` children): DeepSeek TP2 -> TP1, both families
TP1 -> TP2 and TP2 -> TP2."""

from __future__ import annotations

import json
import sys
import urllib.request
from pathlib import Path

import pytest

from _hf import VOCAB, save_hf_model

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "disagg"))
from _cluster import make_engine, node_config, wait_for  # noqa: E402
from _procs import NodeProc, free_port, node_dict  # noqa: E402

from pdkv.engine import LLMEngine, SamplingParams  # noqa: E402
from pdkv.server.app import NODE  # noqa: E402

PROMPTS = [list(range(3, 3 + n)) for n in (2, 7, 13, 30, 45)]  # odd count: D2 alternates its two peers
MAX_TOKENS = 6
FAMILIES = {
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM", dict(
        hidden_size=64, intermediate_size=96, moe_intermediate_size=32, vocab_size=VOCAB,
        max_position_embeddings=256, kv_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16,
        n_routed_experts=8, num_experts_per_tok=2, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=4, q_lora_rank=24, n_group=2, topk_group=1, n_shared_experts=1,
        first_k_dense_replace=1)),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        intermediate_size=96, moe_intermediate_size=32, vocab_size=VOCAB, max_position_embeddings=256,
        num_experts=8, num_experts_per_tok=2, norm_topk_prob=True)),
}


def _complete(url: str, prompt: list[int]) -> list[int]:
    name = json.loads(urllib.request.urlopen(url + "/v1/models").read())["data"][0]["id"]
    body = json.dumps({"model": name, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
                       "ignore_eos": True, "return_token_ids": True}).encode()
    req = urllib.request.Request(url + "/v1/completions", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.loads(r.read())["choices"][0]["token_ids"]


def _reference(model_dir):
    eng = make_engine(node_config(model_dir, "colocated"))
    outs = eng.generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True))
    return [o.output_token_ids for o in outs]


class Nodes:
    """P1, P2 (prefill TP1/TP2); D1 (TP1 <- P2), D2 (TP2 <- P1, P2), as tests/disagg/test_sharded.py."""

    def __init__(self, model_dir):
        from pdkv.disagg.node import DecodeNode, PrefillNode
        from pdkv.server.runner import ServerThread

        self.threads, self.engines = [], []

        def start(role, tp, node_cls, **over):
            cfg = node_config(model_dir, role, parallel__tp=tp, parallel__timeout_s=30.0, **over)
            eng = make_engine(cfg) if tp == 1 else LLMEngine.from_config(cfg, num_threads=1)
            self.engines.append(eng)
            t = ServerThread(cfg, eng, node_cls(cfg, eng)).start()
            self.threads.append(t)
            return t

        self.p1 = start("prefill", 1, PrefillNode)
        self.p2 = start("prefill", 2, PrefillNode)
        addr = {n: f"127.0.0.1:{t.app[NODE].control_port}" for n, t in (("p1", self.p1), ("p2", self.p2))}
        self.d1 = start("decode", 1, DecodeNode, messenger__prefill_peers=[addr["p2"]])
        # no prefix affinity: a prompt repeated goes to the other peer (ties rotate), so both serve it
        self.d2 = start("decode", 2, DecodeNode, messenger__prefill_peers=[addr["p1"], addr["p2"]],
                        disagg__affinity_pages=0)

    def close(self):
        for t in reversed(self.threads):
            t.stop()
        for e in self.engines:
            e.close()

    def pools_full(self) -> bool:
        return all(e.allocator.num_free == e.allocator.num_total for e in self.engines)


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory, tiny_model_dir):
    cfg_name, model_name, kw = FAMILIES[request.param]
    d = tmp_path_factory.mktemp(request.param)
    save_hf_model(cfg_name, model_name, kw, d, tiny_model_dir)
    n = Nodes(d)
    n.name, n.dir, n.want = request.param, d, _reference(d)
    yield n
    n.close()


@pytest.mark.parametrize("decode", ["d1", "d2"])
def test_greedy_tokens_equal_colocated(family, decode):
    """d1: prefill TP2 -> decode TP1; d2: prefill TP1 -> decode TP2 and TP2 -> TP2 in turn."""
    node = getattr(family, decode)
    c = node.app[NODE].coordinator
    got = [[_complete(node.url, p) for p in PROMPTS] for _ in range(2)]  # each prompt via both of d2's peers
    assert got[0] == got[1] == family.want
    geo = c.kv.spec.geometry
    if family.name == "deepseek_v3":
        assert geo.kv_parts == 1 and geo.replicated and geo.head_dim == 32 + 8
        # every rank is a replica set on both sides: each decode rank's page comes whole from one rank
        for peer in c.peers:
            assert len(peer.plan.decode.replica_sets) == peer.plan.decode.tp
            assert peer.plan.writes_per_page == (1,) * peer.plan.decode.tp
    else:
        assert geo.kv_parts == 2 and not geo.replicated
    served = sorted((p.plan.prefill.tp, p.plan.decode.tp) for p in c.peers)
    assert served == ([(2, 1)] if decode == "d1" else [(1, 2), (2, 2)])
    wait_for(family.pools_full, 10, "every page back in every pool")


def test_deepseek_tp2_to_tp1_over_verbs(family, tmp_path, loopback_verbs_dir):
    if family.name != "deepseek_v3":
        pytest.skip("one verbs run: the latent layout (the GQA families run over verbs in tests/disagg)")
    env = {"LD_LIBRARY_PATH": loopback_verbs_dir}
    cport = free_port()

    def proc(name, role, tp, **kw):
        d = node_dict(family.dir, role, port=free_port(), transport="verbs", nics=["lo_verbs0"], **kw)
        d["parallel"] = {"tp": tp, "timeout_s": 30.0}
        return NodeProc(tmp_path, name, d, env)

    procs = [proc("p2", "prefill", 2, control_port=cport)]
    try:
        procs.append(proc("d1", "decode", 1, peers=[f"127.0.0.1:{cport}"]))
        for p in procs:
            p.wait_healthy(120)
        d1 = procs[1]
        wait_for(lambda: all(peer["connected"] for peer in d1.health()["prefill_peers"]), 30, "peer connected")
        assert [_complete(d1.url, p) for p in PROMPTS] == family.want, d1.log_path
        for p in procs:
            wait_for(lambda: p.health()["num_pages_free"] == p.health()["num_pages_total"], 10, "pages back")
    finally:
        for p in reversed(procs):
            p.stop()


def test_tp1_and_tp2_to_tp2_over_verbs(family, tmp_path, loopback_verbs_dir):
    """Decode TP2 fed by a TP1 and a TP2 prefill node over the loopback verbs device (prefill
    TP1 -> decode TP2 and TP2 -> TP2): run twice, every prompt goes through each of the two peers
    (round robin over an odd number of prompts), and every answer equals colocated."""
    env = {"LD_LIBRARY_PATH": loopback_verbs_dir}
    c1, c2 = free_port(), free_port()

    def proc(name, role, tp, **kw):
        d = node_dict(family.dir, role, port=free_port(), transport="verbs", nics=["lo_verbs0"], **kw)
        d["parallel"] = {"tp": tp, "timeout_s": 30.0}
        if role == "decode":
            d["disagg"]["affinity_pages"] = 0  # a repeated prompt goes to the other peer (ties rotate)
        return NodeProc(tmp_path, name, d, env)

    procs = [proc("p1", "prefill", 1, control_port=c1), proc("p2", "prefill", 2, control_port=c2)]
    try:
        procs.append(proc("d2", "decode", 2, peers=[f"127.0.0.1:{c1}", f"127.0.0.1:{c2}"]))
        for p in procs:
            p.wait_healthy(120)
        d2 = procs[2]
        wait_for(lambda: [peer["connected"] for peer in d2.health()["prefill_peers"]] == [True, True], 30,
                 "both prefill peers connected")
        got = [[_complete(d2.url, p) for p in PROMPTS] for _ in range(2)]
        assert got[0] == got[1] == family.want, d2.log_path
        for p in procs:
            wait_for(lambda: p.health()["num_pages_free"] == p.health()["num_pages_total"], 10, "pages back")
    finally:
        for p in reversed(procs):
            p.stop()
