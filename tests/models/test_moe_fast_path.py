"""The batch-1 fast paths of the MoE and MLA families give what the general paths give:
- routed experts: a one-token step runs its k experts directly (models/moe.py ``_one_token``);
  it must equal the grouped path (sort by expert, one GEMM per expert) bit for bit, with all
  experts on this rank and under expert parallelism;
- end to end: one sequence at a time (every decode step one token, so through the fast paths)
  matches transformers token for token, with last-step logits within 1e-4; for DeepSeek also
  with attention biases, which MLA's fused input projection (models/mla.py) must carry over."""

from __future__ import annotations

import pytest
import torch

from _hf import assert_matches_hf, engine, prompts, save_hf_model
from pdkv.models.config import parse_arch_config
from pdkv.models.moe import Experts, SparseMoE
from pdkv.models.parallel import TPLayout
from test_deepseek_v3 import BASE as DS_BASE
from test_deepseek_v3 import CASES as DS_CASES
from test_qwen3_moe import BASE as QWEN_BASE
from test_qwen3_moe import CASES as QWEN_CASES

# 3 experts per token: with 2 the order of the additions could not matter (a + b == b + a)
ROUTING = {
    "softmax": ("Qwen3MoeForCausalLM", {**QWEN_BASE, **QWEN_CASES["norm_topk"], "num_experts_per_tok": 3}),
    # 4 heads: the 2-rank layout must divide them (the heads play no part in the block)
    "sigmoid_groups": ("DeepseekV3ForCausalLM", {**DS_BASE, **DS_CASES["yarn_groups"], "num_attention_heads": 4,
                                                 "num_key_value_heads": 4, "num_experts_per_tok": 3}),
}


def _block(arch: str, kw: dict, ep_rank: int | None = None) -> SparseMoE:
    cfg = parse_arch_config({"architectures": [arch], "model_type": "x", **kw})
    if ep_rank is not None:  # this rank's half of the experts (expert parallelism over 2 ranks)
        cfg = TPLayout(ep_rank, 2, cfg, expert_parallel=True).local_arch()
    torch.manual_seed(0)
    block = SparseMoE(cfg, torch.float32)
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(0.2 * torch.randn_like(p))
    return block


@pytest.mark.parametrize("ep_rank", [None, 0, 1])
@pytest.mark.parametrize("routing", list(ROUTING))
def test_one_token_path_equals_grouped_path(routing, ep_rank, monkeypatch):
    block = _block(*ROUTING[routing], ep_rank=ep_rank)
    calls = []
    real = Experts._one_token
    monkeypatch.setattr(Experts, "_one_token", lambda self, *a: calls.append(1) or real(self, *a))
    gen = torch.Generator().manual_seed(1)
    for _ in range(20):  # different tokens pick different experts
        x = torch.randn(1, block.gate.weight.shape[1], generator=gen)
        ids, weights = block.gate.forward(x)
        fast = block.experts.forward(x, ids, weights)
        monkeypatch.setattr(block.experts, "force_grouped", True)
        grouped = block.experts.forward(x, ids, weights)
        monkeypatch.setattr(block.experts, "force_grouped", False)
        assert torch.equal(fast, grouped), (ids, (fast - grouped).abs().max())
        if ep_rank is None:
            assert fast.abs().sum() > 0
    assert len(calls) == 20, "the fast path did not run"


FAMILIES = {
    "qwen3_moe": ("Qwen3Moe", {**QWEN_BASE, **QWEN_CASES["norm_topk"]}),
    "deepseek_v3": ("DeepseekV3", {**DS_BASE, **DS_CASES["yarn_groups"]}),
    # MLA's fused input projection with biases: kv_a_proj's, and none on a plain q_proj (which
    # the fused bias pads with zeros) / q_a_proj's
    "deepseek_v3_bias_q_proj": ("DeepseekV3", {**DS_BASE, **DS_CASES["null_q_lora"], "attention_bias": True}),
    "deepseek_v3_bias_q_lora": ("DeepseekV3", {**DS_BASE, **DS_CASES["yarn_groups"], "attention_bias": True}),
}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_one_sequence_at_a_time_matches_transformers(family, tmp_path, tiny_model_dir, monkeypatch):
    name, kw = FAMILIES[family]
    model = save_hf_model(f"{name}Config", f"{name}ForCausalLM", kw, tmp_path, tiny_model_dir)
    calls = []
    real = Experts._one_token
    monkeypatch.setattr(Experts, "_one_token", lambda self, *a: calls.append(1) or real(self, *a))
    assert_matches_hf(model, engine(tmp_path, max_seqs=1), prompts(lens=(5, 23)), f"{family}/batch-1")
    assert len(calls) >= 2 * 31, "decode steps did not take the one-token path"
