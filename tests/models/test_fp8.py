"""Block-quantized FP8 checkpoints (the official DeepSeek-V3/R1 format, tests/models/_fp8.py) of a
tiny DeepSeek-V3 (MLA + MoE, with kv_a_proj_with_mqa's 192 rows: a partial last block, as R1's
576) and a tiny Qwen3-MoE: pdkv loads them as stored (FP8 + scales; what the checkpoint leaves
unquantized keeps its dtype) and serves greedy tokens equal to transformers' on the
block-dequantized float32 weights.

Bound on the logits: both sides multiply the same float32 dequantized values (w * s, one
rounding, the same bits), so what remains is float32 summation order, the 1e-4 relative bound
of the float32 parity tests (tests/models/test_deepseek_v3.py). Against the unquantized
weights e4m3's 3-bit mantissa (relative step 2^-3, rounding error <= 2^-4 per weight) moves
the logits by a few percent: checked loosely (< 0.2) to show the quantization really happened.
"""

from __future__ import annotations

import pytest
import torch

from _fp8 import FAMILIES
from _hf import assert_matches_hf, engine, prompts, run_greedy

@pytest.mark.parametrize("family", list(FAMILIES))
def test_greedy_matches_transformers_on_dequantized_weights(family, fp8_models):
    ref, original, folder = fp8_models[family]
    eng = engine(folder)
    assert_matches_hf(ref, eng, prompts(), f"fp8/{family}")
    # ... and the FP8 model is not the unquantized one (the quantization is real).
    _, logits = run_greedy(engine(folder), prompts()[:1], 1)
    with torch.no_grad():
        full = original(input_ids=torch.tensor([prompts()[0]])).logits[0, -1]
    rel = float((logits[0] - full).norm() / full.norm())
    assert 1e-4 < rel < 0.2, rel


@pytest.mark.parametrize("family", list(FAMILIES))
def test_weights_stay_as_stored(family, fp8_models):
    """Every Linear of the decoder layers is FP8 with a float32 scale per 128 x 128 block;
    embeddings, norms, lm_head and the router keep the checkpoint's float32."""
    _, _, folder = fp8_models[family]
    m = engine(folder).loaded.model
    fp8 = {n for n, p in m.named_parameters() if p.dtype == torch.float8_e4m3fn}
    plain = {n: p.dtype for n, p in m.named_parameters() if n not in fp8}
    assert all(".layers." in n for n in fp8)
    assert {"model.embed_tokens.weight", "lm_head.weight", "model.norm.weight"} <= set(plain)
    assert all(d == torch.float32 for d in plain.values())
    assert "model.layers.1.mlp.experts.gate_up_proj" in fp8 and "model.layers.1.mlp.experts.down_proj" in fp8
    assert "model.layers.1.mlp.gate.weight" in plain
    g = m.model.layers[1].mlp.experts
    assert g.gate_up_proj_scale_inv.shape == (8, 4, 2) and g.down_proj_scale_inv.shape == (8, 2, 2)
    if family == "deepseek_v3":
        attn = m.model.layers[0].self_attn
        for name in ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "o_proj"):
            assert getattr(attn, name).weight.dtype == torch.float8_e4m3fn, name
        assert attn.kv_a_proj_with_mqa.weight_scale_inv.shape == (2, 2)  # 192 rows: 1.5 blocks
        assert attn.kv_b_proj.weight.dtype == torch.float32  # dequantized once (absorbed path)
        assert "model.layers.1.mlp.shared_experts.gate_up_proj.weight" in fp8
        assert "model.layers.1.mlp.gate.e_score_correction_bias" in plain
    else:
        assert "model.layers.0.self_attn.qkv_proj.weight" in fp8
        assert m.model.layers[0].self_attn.qkv_proj.weight_scale_inv.shape == (8, 2)


def test_bf16_model_dtype_and_kernels_off(fp8_models):
    """model.dtype bfloat16 (FP8 layers still dequantize to float32) and model.cpu_kernels off
    (torch's GEMMs) serve the same FP8 checkpoint; bf16 agrees on the first tokens."""
    _, _, folder = fp8_models["deepseek_v3"]
    ps = prompts(seed=4, lens=(9,))
    ref, _ = run_greedy(engine(folder), ps, 8)
    off, _ = run_greedy(engine(folder, cpu_kernels=False), ps, 8)
    assert off == ref
    bf, _ = run_greedy(engine(folder, dtype="bfloat16"), ps, 8)
    assert bf[0][:2] == ref[0][:2]


@pytest.mark.parametrize("shape", [(192, 256), (300, 200), (128, 129)])
def test_dequantize_kernel_gives_torch_bits(shape, monkeypatch):
    """pdkv/kernels/fp8.c (a decode table, one multiply) == torch's w.float() * s, partial
    blocks in either dimension included."""
    from pdkv.models import fp8

    torch.manual_seed(1)
    q, s = fp8.quantize(torch.randn(*shape))
    got = fp8.dequantize(q, s, (128, 128)).clone()
    monkeypatch.setattr(fp8, "_k", None)  # torch's conversion and broadcast multiply
    assert torch.equal(got, fp8.dequantize(q, s, (128, 128)))
    assert torch.equal(got, q.float() * s.repeat_interleave(128, 0)[:shape[0]].repeat_interleave(128, 1)[:, :shape[1]])
