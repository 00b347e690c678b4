"""``pdkv plan`` on the seed's deployments, checked against hand computations from the model
cards' shapes (DeepSeek-R1: 61 layers, a 512 + 64 latent per token and layer; Qwen3-Coder-480B:
62 layers, 8 KV heads of 128), on the DGX-H100-like topology fixture. No weights are read."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pdkv.cli import main
from test_plan_memory import r1_fp8_weights_per_rank

ROOT = Path(__file__).resolve().parents[2]
TOPO = str(ROOT / "tests" / "topo" / "fixtures" / "dgx-h100")
PREFILL_NICS = ["mlx5_0", "mlx5_1", "mlx5_2", "mlx5_3", "mlx5_6", "mlx5_7", "mlx5_8", "mlx5_9"]  # GPU r's nearest


def _plan(capsys, cfg: str, prompt_len: int, *extra: str) -> dict:
    assert main(["plan", "-c", str(ROOT / cfg), "--prompt-len", str(prompt_len), "--topo", TOPO, "--json",
                 *extra]) == 0
    return json.loads(capsys.readouterr().out)


def _r1_weights_per_rank(tp: int) -> int:
    """DeepSeek-R1's parameters held by one of ``tp`` ranks, bf16 (router in float32), by hand:
    what the bf16 weights take (test_bf16_weights_without_the_quantization_config)."""
    H, V, L, dense, inter, moe_i, E = 7168, 129280, 61, 3, 18432, 2048, 256
    heads = 128 // tp
    attn = (H * 1536 + 1536 + 1536 * heads * (128 + 64)  # q_a, its norm, q_b (this rank's heads)
            + H * 576 + 512 + 512 * heads * (128 + 128) + heads * 128 * H)  # kv_a, norm, kv_b, o_proj
    per_layer = attn + 2 * H  # + input / post-attention norms
    mlp_dense = 3 * H * inter // tp
    moe = E * 3 * H * moe_i // tp + 3 * H * moe_i // tp  # routed experts (sliced) + 1 shared expert
    bf16 = 2 * (2 * V * H + H + L * per_layer + dense * mlp_dense + (L - dense) * moe)  # embed + lm_head + norm
    return bf16 + 4 * (L - dense) * (E * H + E)  # router weight and correction bias, float32


def test_deepseek_r1_tp8_to_tp8_matches_the_hand_computation(capsys):
    r = _plan(capsys, "configs/deepseek-r1/cluster-tp8.yaml", 4097)
    per_token = 61 * (512 + 64) * 2
    assert r["kv_bytes_per_token"] == per_token == 70_272
    assert r["tokens_moved"] == 4096 and r["pages"] == 4096 // 64
    assert r["kv_bytes_per_request"] == 4096 * per_token
    # Replicated latent: every decode rank gets the whole cache, one write per page and layer,
    # each from a different prefill rank (one NIC each).
    assert sorted(p["decode_rank"] for p in r["pairs"]) == list(range(8))
    assert sorted(p["prefill_rank"] for p in r["pairs"]) == list(range(8))
    for p in r["pairs"]:
        assert p["writes"] == 64 * 61 and p["bytes"] == 64 * 61 * 64 * 576 * 2
    assert r["expected_writes_per_decode_rank"] == [64 * 61] * 8
    assert r["expected_immediates"] == 8 * 64 * 61 + 1 == 31_233
    hidden = 7168 * 2
    assert r["wire_bytes"] == 8 * 4096 * per_token + hidden
    tx = r["nic_bytes"]["prefill"]
    assert sorted(tx) == PREFILL_NICS
    assert tx["mlx5_0"] == 4096 * per_token + hidden and tx["mlx5_9"] == 4096 * per_token
    assert r["weight_bytes_per_rank"]["prefill"] == [r1_fp8_weights_per_rank(8)] * 8  # as published
    assert all(abs(s - 1 / 8) < 0.02 for s in r["prefill_rank_share"].values())


def test_deepseek_r1_data_parallel_decode_moves_one_copy(capsys):
    r = _plan(capsys, "configs/deepseek-r1/cluster-dp8.yaml", 1000)
    assert r["decode"]["tp"] == 1 and r["decode"]["dp"] == 8
    (pair,) = r["pairs"]  # the one DP rank that decodes it, fed by one seeded prefill rank
    pages = -(-999 // 64)
    assert pair["writes"] == pages * 61 and r["expected_immediates"] == pages * 61 + 1
    assert r["wire_bytes"] == pages * 61 * 64 * 576 * 2 + 7168 * 2
    # A DP8-EP rank: everything whole but 32 of the 256 routed experts: more than a TP8 rank, less than TP1.
    w = r["weight_bytes_per_rank"]["decode"]
    assert len(w) == 8 and r1_fp8_weights_per_rank(8) < w[0] < r1_fp8_weights_per_rank(1) / 4
    assert all(abs(s - 1 / 8) < 0.02 for s in r["prefill_rank_share"].values())
    c = r["dp_vs_tp"]  # next to TP8 on the same GPUs: 1/8 of the wire bytes, more KV per node
    assert c["dp_wire_bytes"] == r["wire_bytes"] and c["tp_wire_bytes"] - 7168 * 2 == 8 * (r["wire_bytes"] - 7168 * 2)
    assert c["tp_weight_bytes_per_rank"] == r1_fp8_weights_per_rank(8)
    assert c["node_kv_tokens_dp"] > 5 * c["node_kv_tokens_tp"] > 0


def test_qwen3_coder_tp8_to_tp8_moves_each_rank_one_head(capsys):
    r = _plan(capsys, "configs/qwen3-coder/cluster-1p3d.yaml", 2048)
    assert r["decode"]["nodes"] == 3 and r["cache"] == "kv" and not r["replicated"]
    assert r["kv_bytes_per_token"] == 62 * 2 * 8 * 128 * 2
    pages = -(-2047 // 64)
    # One KV head per rank on both sides: rank r -> rank r, and the rank's HND page (K then V of
    # its one head) is one contiguous run: one write per page and layer.
    assert [(p["prefill_rank"], p["decode_rank"]) for p in r["pairs"]] == [(i, i) for i in range(8)]
    assert all(p["writes"] == pages * 62 and p["bytes"] == pages * 62 * 2 * 64 * 128 * 2 for p in r["pairs"])
    assert r["expected_immediates"] == 8 * pages * 62 + 1
    assert r["wire_bytes"] == pages * 64 * r["kv_bytes_per_token"] + 6144 * 2


def test_bf16_weights_without_the_quantization_config(capsys, tmp_path):
    """A bf16 copy of R1 (its config.json without quantization_config) plans 161 GiB per rank."""
    model = tmp_path / "model"
    model.mkdir()
    cfg = json.loads((ROOT / "configs/deepseek-r1/model/config.json").read_text())
    cfg.pop("quantization_config")
    (model / "config.json").write_text(json.dumps(cfg))
    dep = tmp_path / "dep.yaml"
    dep.write_text(f"model: {{path: {model}, dtype: bfloat16}}\nkv_cache: {{page_size: 64}}\nparallel: {{tp: 8}}\n")
    assert main(["plan", "-c", str(dep), "--json", "--gpu-memory-gib", "141"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["weight_bytes_per_rank"]["prefill"] == [_r1_weights_per_rank(8)] * 8
    assert r["memory"]["prefill"]["fits"] is False


def test_text_report_and_bad_files(capsys, tmp_path):
    assert main(["plan", "-c", str(ROOT / "configs/deepseek-r1/cluster-tp8.yaml"), "--topo", TOPO]) == 0
    out = capsys.readouterr().out
    assert "latent, 576 values/token/layer, replicated on every rank" in out and "KV bytes per token: 70,272" in out
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: {path: /nonexistent}\nprefill: {parallel: {tp: 8}}\n")
    assert main(["plan", "-c", str(bad)]) == 2
    assert "model.path '/nonexistent' has no config.json" in capsys.readouterr().err
    bad.write_text(f"model: {{path: {ROOT / 'configs/deepseek-r1/model'}}}\nprefill: {{parallel: {{tp: 3}}}}\n")
    assert main(["plan", "-c", str(bad)]) == 2
    assert "num_attention_heads=128" in capsys.readouterr().err


@pytest.mark.parametrize("cfg", ["configs/deepseek-r1/prefill-tp8.yaml", "configs/deepseek-r1/decode-tp8.yaml",
                                 "configs/deepseek-r1/decode-dp8.yaml", "configs/deepseek-r1/prefill-dp8.yaml",
                                 "configs/qwen3-coder/prefill-tp8.yaml",
                                 "configs/qwen3-coder/decode-tp8.yaml"])
def test_role_files_are_valid_configs(cfg, capsys):
    assert main(["config", "-c", str(ROOT / cfg)]) == 0
    capsys.readouterr()
