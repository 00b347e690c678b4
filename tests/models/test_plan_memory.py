"""``pdkv plan``'s memory verdicts for the seed's deployments as published (FP8 block-quantized
checkpoints: configs/*/model/config.json carry the quantization_config), on H100 80 GB and H200
141 GB GPUs, against hand computations from the model cards' shapes."""

from __future__ import annotations

import json
import math
from pathlib import Path

from pdkv.cli import main

ROOT = Path(__file__).resolve().parents[2]
GIB = 1 << 30


def fp8(n: int, k: int) -> int:
    """An FP8 weight [n, k] and its float32 scale per 128 x 128 block (partial ones included)."""
    return n * k + math.ceil(n / 128) * math.ceil(k / 128) * 4


def r1_fp8_weights_per_rank(tp: int) -> int:
    H, V, L, dense, inter, moe_i, E = 7168, 129280, 61, 3, 18432, 2048, 256
    heads = 128 // tp
    attn = (fp8(1536, H) + 2 * 1536 + fp8(heads * 192, 1536) + fp8(576, H) + 2 * 512
            + 2 * heads * 256 * 512  # kv_b_proj: dequantized to bf16 at load (absorbed MLA)
            + fp8(H, heads * 128))
    per_layer = attn + 2 * 2 * H
    i, m = inter // tp, moe_i // tp
    dense_mlp = fp8(2 * i, H) + fp8(H, i)
    moe = E * (fp8(2 * m, H) + fp8(H, m)) + fp8(2 * m, H) + fp8(H, m) + 4 * (E * H + E)  # + shared, router
    return 2 * (2 * V * H + H) + L * per_layer + dense * dense_mlp + (L - dense) * moe


def qwen3_coder_fp8_weights_per_rank(tp: int, expert_parallel: bool = False) -> int:
    H, V, L, E, moe_i = 6144, 151936, 62, 160, 2560
    q, kv, m = 96 // tp * 128, 8 // tp * 128, moe_i // tp
    attn = fp8(q + 2 * kv, H) + fp8(H, q) + 2 * 2 * 128  # qkv, o_proj, q/k norms
    if expert_parallel:  # E / tp whole experts
        moe = E // tp * (fp8(2 * moe_i, H) + fp8(H, moe_i)) + 2 * E * H
    else:  # every expert's rows / tp
        moe = E * (fp8(2 * m, H) + fp8(H, m)) + 2 * E * H  # experts, the (bf16) router
    return 2 * (2 * V * H + H) + L * (attn + moe + 2 * 2 * H)


def _plan(capsys, cfg, *extra):
    assert main(["plan", "-c", str(cfg), "--json", *extra]) == 0
    return json.loads(capsys.readouterr().out)


def _room(gpu_gib: float, weights: int, per_token: int) -> int:
    return int((int(gpu_gib * GIB) - weights) * 0.85) // per_token


def test_deepseek_r1_tp8_does_not_fit_an_h100_and_fits_an_h200(capsys):
    w = r1_fp8_weights_per_rank(8)
    assert 82 * GIB < w < 83 * GIB  # half of the 161 GiB the bf16 weights would take
    r = _plan(capsys, ROOT / "configs/deepseek-r1/cluster-tp8.yaml")  # deployment.gpu_memory_gib: 80
    assert r["weight_bytes_per_rank"]["prefill"] == [w] * 8
    for side in ("prefill", "decode"):
        m = r["memory"][side]
        assert m["fits"] is False and m["short_bytes"] == w - 80 * GIB
        assert m["text"].startswith("does not fit: weights exceed the 80 GiB GPU by 2.6")
    r = _plan(capsys, ROOT / "configs/deepseek-r1/cluster-tp8.yaml", "--gpu-memory-gib", "141")
    per_token = 61 * 576 * 2  # bf16 latent, whole on every rank
    m = r["memory"]["decode"]
    assert m["fits"] and m["kv_bytes_per_token_per_rank"] == per_token
    assert m["kv_tokens"] == _room(141, w, per_token) and m["requests_4k"] == m["kv_tokens"] // 4096
    assert m["requests_4k"] > 100


def test_qwen3_coder_tp8_fp8_is_refused_and_tp4_plans(capsys, tmp_path):
    """moe_intermediate_size 2560 / 8 = 320 rows per rank cut a 128-block (vLLM refuses the same
    split); at TP4 (640 = 5 blocks) the weights do not fit an H100 and fit an H200."""
    tp8 = tmp_path / "tp8.yaml"
    tp8.write_text(f"model: {{path: {ROOT / 'configs/qwen3-coder/model'}, dtype: bfloat16}}\n"
                   "kv_cache: {page_size: 64}\nparallel: {tp: 8}\n")
    r = _plan(capsys, tp8)
    for side in ("prefill", "decode"):
        m = r["memory"][side]
        assert m["fits"] is False and "takes columns [0, 320) of 2560, which cuts a 128-wide FP8 block" in m["text"]
        assert "parallel.tp=8" in m["text"]
    cfg = tmp_path / "tp4.yaml"
    cfg.write_text(f"model: {{path: {ROOT / 'configs/qwen3-coder/model'}, dtype: bfloat16}}\n"
                   "kv_cache: {page_size: 64, dtype: fp8_e4m3}\nparallel: {tp: 4}\n")
    w = qwen3_coder_fp8_weights_per_rank(4)
    r = _plan(capsys, cfg, "--gpu-memory-gib", "80")
    assert r["weight_bytes_per_rank"]["decode"] == [w] * 4
    assert r["memory"]["decode"]["fits"] is False and r["memory"]["decode"]["short_bytes"] == w - 80 * GIB
    r = _plan(capsys, cfg, "--gpu-memory-gib", "141")
    per_token = 62 * 2 * 2 * 128 * 1  # two KV heads per rank, K and V, one byte each (fp8 KV)
    m = r["memory"]["decode"]
    assert r["kv_dtype"] == "float8_e4m3fn" and r["kv_bytes_per_token"] == 62 * 2 * 8 * 128
    assert m["fits"] and m["kv_bytes_per_token_per_rank"] == per_token
    assert m["kv_tokens"] == _room(141, w, per_token)


def test_qwen3_coder_tp8_with_expert_parallelism_fits_an_h200(capsys, tmp_path):
    """parallel.expert_parallel: 20 whole experts per rank, no block cut (what vLLM needs for
    this checkpoint at TP8 too)."""
    cfg = tmp_path / "ep.yaml"
    cfg.write_text(f"model: {{path: {ROOT / 'configs/qwen3-coder/model'}, dtype: bfloat16}}\n"
                   "kv_cache: {page_size: 64}\nparallel: {tp: 8, expert_parallel: true}\n")
    w = qwen3_coder_fp8_weights_per_rank(8, expert_parallel=True)
    r = _plan(capsys, cfg, "--gpu-memory-gib", "141")
    assert r["weight_bytes_per_rank"]["decode"] == [w] * 8
    m = r["memory"]["decode"]
    assert m["fits"] and m["kv_tokens"] == _room(141, w, 62 * 2 * 1 * 128 * 2)
    assert main(["config", "-c", str(cfg)]) == 0  # a valid config
    capsys.readouterr()
    r = _plan(capsys, ROOT / "configs/qwen3-coder/cluster-1p3d.yaml", "--gpu-memory-gib", "80")
    assert r["memory"]["decode"]["fits"] and r["weight_bytes_per_rank"]["prefill"] == [w] * 8


def test_text_verdicts(capsys):
    assert main(["plan", "-c", str(ROOT / "configs/deepseek-r1/cluster-tp8.yaml"), "--gpu-memory-gib", "141"]) == 0
    out = capsys.readouterr().out
    assert "memory per rank (weights fp8 (e4m3, block scales), KV cache bfloat16):" in out
    assert "decode: weights 82.63 GiB, KV 70,272 B/token on a 141 GiB GPU: fits:" in out
    assert "concurrent 4096-token requests" in out
