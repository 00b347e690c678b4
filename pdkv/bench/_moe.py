"""The MoE bench models of ``python -m pdkv.bench engine --model-kind deepseek_v3|qwen3_moe``:
seeded random transformers models saved as Hugging Face folders (no download), and the
active-parameter floor of a decode step.

Sizes (float32): Qwen3-MoE hidden 512, 8 layers, 8 heads / 2 KV heads of 64, 32 experts of 256
(top 4), vocab 32000; DeepSeek-V3 the same trunk with MLA (q_lora 256, kv_lora 128, rope 32, nope
64, v 64), 32 experts in 4 groups (2 kept, top 4), one shared expert, the first layer dense.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

KINDS = {
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(
        hidden_size=512, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=2, head_dim=64,
        intermediate_size=1536, moe_intermediate_size=256, num_experts=32, num_experts_per_tok=4,
        norm_topk_prob=True, vocab_size=32000, max_position_embeddings=4096)),
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM", dict(
        hidden_size=512, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=8, q_lora_rank=256,
        kv_lora_rank=128, qk_rope_head_dim=32, qk_nope_head_dim=64, v_head_dim=64, intermediate_size=1536,
        moe_intermediate_size=256, n_routed_experts=32, num_experts_per_tok=4, n_group=4, topk_group=2,
        n_shared_experts=1, first_k_dense_replace=1, vocab_size=32000, max_position_embeddings=4096)),
}


def make_moe_model(kind: str, folder: Path) -> Path:
    """Writes the ``kind`` bench model (weights ~N(0, 0.02), norms 1) with the tiny-model tokenizer."""
    import transformers

    from pdkv.tiny_model import make_tiny_model

    cfg_name, model_name, kw = KINDS[kind]
    torch.manual_seed(0)
    model = getattr(transformers, model_name)(getattr(transformers, cfg_name)(**kw)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.normal_(0.0, 0.02)
    model.save_pretrained(folder)
    tok = make_tiny_model(folder.parent / f"{kind}-tokenizer", num_layers=1, vocab_size=32000, seed=0)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tok / f, folder / f)
    return folder


def active_decode_bytes(model) -> int:
    """Bytes one batch-1 decode step must read: every parameter but the embedding table (one row
    is gathered) and the routed experts, plus top_k routed experts per sparse layer."""
    from pdkv.models.moe import Experts  # noqa: PLC0415

    total = sum(p.numel() * p.element_size() for p in model.parameters())
    if model.lm_head is not None:
        emb = model.model.embed_tokens.weight
        total -= emb.numel() * emb.element_size()
    for m in model.modules():
        if isinstance(m, Experts):
            per_expert = (m.gate_up_proj[0].numel() + m.down_proj[0].numel()) * m.gate_up_proj.element_size()
            total -= per_expert * m.gate_up_proj.shape[0]
            total += per_expert * model.cfg.moe.top_k
    return total
