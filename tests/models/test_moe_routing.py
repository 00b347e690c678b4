"""The MoE router's torch path (models/moe.py ``Router`` with its C kernel off: what runs for
bfloat16 and with model.cpu_kernels false) against transformers' own routers on the same
weights: Qwen3MoeTopKRouter (softmax top-k, normalised or not) and DeepseekV3TopkRouter (sigmoid
scores, the selection-only correction bias, group-limited top-k, normalisation, the routed
scaling factor). The same experts per token and their weights within 1e-6; the C kernel against
the same reference too, so each of the two paths has a reference of its own."""

from __future__ import annotations

import pytest
import torch

from pdkv.models.config import parse_arch_config
from pdkv.models.moe import Router
from test_deepseek_v3 import BASE as DS0
from test_qwen3_moe import BASE as QWEN_BASE

DS_BASE = {**DS0, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 4, "q_lora_rank": None,
           "n_shared_experts": 1, "first_k_dense_replace": 0}
CASES = {
    "qwen3_norm": ("Qwen3Moe", {**QWEN_BASE, "norm_topk_prob": True}),
    "qwen3_unnormalised_k3": ("Qwen3Moe", {**QWEN_BASE, "norm_topk_prob": False, "num_experts_per_tok": 3}),
    # 2 of 4 groups of 2 experts kept: a group scores the sum of its two best
    "deepseek_groups": ("DeepseekV3", {**DS_BASE, "n_group": 4, "topk_group": 2, "norm_topk_prob": True,
                                       "num_experts_per_tok": 3}),
    "deepseek_one_group_unnormalised": ("DeepseekV3", {**DS_BASE, "n_group": 1, "topk_group": 1,
                                                       "norm_topk_prob": False}),
}


def _routers(family: str, kw: dict):
    import transformers
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    hf_cfg = getattr(transformers, f"{family}Config")(**kw)
    hf = (Qwen3MoeTopKRouter if family == "Qwen3Moe" else DeepseekV3TopkRouter)(hf_cfg)
    ours = Router(parse_arch_config({"architectures": [f"{family}ForCausalLM"], "model_type": "x", **kw}),
                  torch.float32)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        hf.weight.copy_(torch.randn(hf.weight.shape, generator=g))
        ours.weight.copy_(hf.weight)
        if family == "DeepseekV3":  # large enough to change which experts are chosen
            hf.e_score_correction_bias.copy_(0.3 * torch.randn(hf.e_score_correction_bias.shape, generator=g))
            ours.e_score_correction_bias.copy_(hf.e_score_correction_bias)
    return hf, ours


def _by_expert(ids: torch.Tensor, weights: torch.Tensor):
    order = ids.argsort(-1)
    return ids.gather(-1, order), weights.gather(-1, order)


@pytest.mark.parametrize("kernel", [False, True], ids=["torch", "c-kernel"])
@pytest.mark.parametrize("case", list(CASES))
def test_router_matches_transformers(case, kernel):
    hf, ours = _routers(*CASES[case])
    ours.cpu_kernel = kernel
    x = torch.randn(64, ours.weight.shape[1], generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        _, hf_w, hf_ids = hf(x)
        ids, w = ours(x)
    want_ids, want_w = _by_expert(hf_ids, hf_w)
    got_ids, got_w = _by_expert(ids, w)
    assert torch.equal(got_ids, want_ids), (got_ids != want_ids).any(-1).nonzero()
    torch.testing.assert_close(got_w, want_w.to(got_w.dtype), rtol=1e-6, atol=1e-6)
    if CASES[case][1].get("norm_topk_prob") and CASES[case][0] == "Qwen3Moe":
        torch.testing.assert_close(w.sum(-1), torch.ones(64))  # the case tests what it says
