"""Block-quantized FP8 checkpoints for the tests, in the official DeepSeek-V3/R1 format: every
Linear weight of the decoder layers float8_e4m3fn with a float32 ``weight_scale_inv`` per
128 x 128 block (a partial last block where a dimension is not a multiple of 128), the rest
(embeddings, norms, lm_head, router, e_score_correction_bias) as it was; config.json with the
published ``quantization_config``. Beside it, the same model with the block-dequantized float32
weights (w * s, the one multiply pdkv's dequantization does too) for transformers to run."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from _hf import VOCAB

DEEPSEEK = dict(hidden_size=256, intermediate_size=256, moe_intermediate_size=256, vocab_size=VOCAB,
                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=128,
                kv_lora_rank=128, qk_rope_head_dim=64, qk_nope_head_dim=64, v_head_dim=64,
                n_routed_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1, n_shared_experts=1,
                first_k_dense_replace=1, max_position_embeddings=256, routed_scaling_factor=2.5)
QWEN = dict(hidden_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            head_dim=128, intermediate_size=256, moe_intermediate_size=256, vocab_size=VOCAB,
            max_position_embeddings=256, num_experts=8, num_experts_per_tok=2, norm_topk_prob=True,
            mlp_only_layers=[0])
FAMILIES = {"deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM", DEEPSEEK),
            "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", QWEN)}

QUANT_CONFIG = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                "weight_block_size": [128, 128]}
E4M3_MAX = 448.0


def quantize(w: torch.Tensor, block=(128, 128)) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] float32 → (e4m3 [N, K], scale [ceil(N/bn), ceil(K/bk)]): amax / 448 per block."""
    N, K = w.shape
    bn, bk = block
    nb, kb = math.ceil(N / bn), math.ceil(K / bk)
    padded = torch.zeros(nb * bn, kb * bk)
    padded[:N, :K] = w
    blocks = padded.view(nb, bn, kb, bk)
    scale = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12) / E4M3_MAX
    q = (blocks / scale[:, None, :, None]).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return q.view(nb * bn, kb * bk)[:N, :K].contiguous(), scale.float()


def dequantize(q: torch.Tensor, s: torch.Tensor, block=(128, 128)) -> torch.Tensor:
    N, K = q.shape
    full = s.repeat_interleave(block[0], 0)[:N].repeat_interleave(block[1], 1)[:, :K]
    return q.float() * full


def is_quantized(name: str, t: torch.Tensor) -> bool:
    """What the official checkpoints quantize: the decoder layers' Linear weights."""
    return (name.startswith("model.layers.") and name.endswith(".weight") and "_proj" in name
            and t.dim() == 2)


def make_fp8_pair(src: Path, fp8_dir: Path, deq_dir: Path, block=(128, 128)) -> int:
    """src (a float32 Hugging Face folder) → fp8_dir (quantized) and deq_dir (dequantized
    float32, no quantization_config); returns the FP8 folder's weight bytes."""
    tensors = {}
    with safe_open(str(src / "model.safetensors"), framework="pt") as h:
        for name in h.keys():
            tensors[name] = h.get_tensor(name)
    fp8, deq = {}, {}
    for name, t in tensors.items():
        if is_quantized(name, t):
            q, s = quantize(t.float(), block)
            fp8[name], fp8[name + "_scale_inv"] = q, s
            deq[name] = dequantize(q, s, block)
        else:
            fp8[name] = deq[name] = t
    cfg = json.loads((src / "config.json").read_text())
    for d, ts, qc in ((fp8_dir, fp8, {**QUANT_CONFIG, "weight_block_size": list(block)}), (deq_dir, deq, None)):
        d.mkdir(parents=True, exist_ok=True)
        save_file(ts, str(d / "model.safetensors"), metadata={"format": "pt"})
        c = dict(cfg)
        if qc is not None:
            c["quantization_config"] = qc
        (d / "config.json").write_text(json.dumps(c, indent=1))
        for f in src.iterdir():
            if f.name.startswith("tokenizer") or f.name == "generation_config.json":
                shutil.copy(f, d / f.name)
    return sum(t.numel() * t.element_size() for t in fp8.values())
