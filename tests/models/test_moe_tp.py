"""Tensor parallelism for the MoE / MLA families: TP2 (rank 0 here, rank 1 a real follower process
over gloo, pdkv/tp) produces TP1's logits and greedy tokens for Qwen3-MoE (GQA split, experts
split by intermediate rows) and DeepSeek-V3 (MLA heads split after decompression, the latent
replicated on both ranks); expert parallelism's split sums to the whole block; bad degrees are named."""

from __future__ import annotations

import pytest
import torch

from _hf import VOCAB, save_hf_model
from pdkv.models.config import parse_arch_config
from pdkv.models.moe import SparseMoE
from pdkv.models.parallel import TensorParallelError, TPLayout
from pdkv.config import KVCacheConfig, ModelConfig, ParallelConfig, SchedulerConfig
from pdkv.engine import LLMEngine, SamplingParams

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
PROMPTS = [list(range(3, 40)), [7, 8, 9, 10, 11], list(range(100, 121))]
QWEN = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            intermediate_size=96, moe_intermediate_size=32, vocab_size=VOCAB, max_position_embeddings=256,
            num_experts=8, num_experts_per_tok=2, norm_topk_prob=True, mlp_only_layers=[0])
DEEPSEEK = dict(hidden_size=64, intermediate_size=96, moe_intermediate_size=32, vocab_size=VOCAB,
                max_position_embeddings=256, kv_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=16,
                v_head_dim=16, n_routed_experts=8, num_experts_per_tok=2, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=4, q_lora_rank=24, n_group=2, topk_group=1,
                n_shared_experts=2, first_k_dense_replace=1)


def _engine(folder, tp):
    # Small chunks: a prompt takes several steps, so steps mix prefill chunks with decodes.
    return LLMEngine(ModelConfig(path=str(folder)), KVCacheConfig(page_size=4, num_pages=96),
                     SchedulerConfig(max_num_batched_tokens=24, chunk_size=8, max_num_seqs=4),
                     parallel=ParallelConfig(tp=tp, timeout_s=30.0, startup_timeout_s=120.0))


def _first_logits(engine, prompt):
    engine.add_request("probe", prompt, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
    while engine.has_unfinished():
        if any(o.new_token_ids for o in engine.step()):
            logits = engine.runner.last_logits.clone()
    return logits


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3"])
def test_tp2_matches_tp1(family, tmp_path, tiny_model_dir):
    if family == "qwen3_moe":
        save_hf_model("Qwen3MoeConfig", "Qwen3MoeForCausalLM", QWEN, tmp_path, tiny_model_dir)
    else:
        save_hf_model("DeepseekV3Config", "DeepseekV3ForCausalLM", DEEPSEEK, tmp_path, tiny_model_dir)
    one, two = _engine(tmp_path, 1), _engine(tmp_path, 2)
    try:
        torch.testing.assert_close(_first_logits(two, PROMPTS[0]), _first_logits(one, PROMPTS[0]),
                                   rtol=1e-4, atol=1e-4)
        ref = [o.output_token_ids for o in one.generate(PROMPTS, GREEDY)]
        assert [o.output_token_ids for o in two.generate(PROMPTS, GREEDY)] == ref
        local = two.loaded.arch
        assert local.num_heads == 2 and local.moe.intermediate_size == 16  # this rank's share
        regions = two.tp.regions
        if family == "deepseek_v3":  # the latent is replicated: both ranks wrote the same pages
            assert two.tp.shard_spec.geometry.replicated and two.tp.shard_spec.geometry.kv_parts == 1
            assert [r.kv_heads for r in regions] == [(0,), (0,)]
            for layer in range(two.kv.num_layers):
                a, b = regions[0].cache.layer(layer), regions[1].cache.layer(layer)
                assert a.abs().sum() > 0
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
        else:
            assert [r.kv_heads for r in regions] == [(0,), (1,)]
        assert two.allocator.num_free == two.allocator.num_total
    finally:
        two.close()


def _hf_dict(kw, arch):
    return {"architectures": [arch], "model_type": "x", **kw}


def test_expert_parallel_and_intermediate_split_both_sum_to_the_whole_block():
    """One MoE block (DeepSeek routing, shared experts): the tp ranks' partial outputs, from the
    checkpoint tensors each rank's layout slices, add up to the one-rank block's output."""
    full = parse_arch_config(_hf_dict({**DEEPSEEK, "num_hidden_layers": 2}, "DeepseekV3ForCausalLM"))
    torch.manual_seed(0)
    block = SparseMoE(full, torch.float32)
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(0.2 * torch.randn_like(p))
    ckpt = {}  # the block's tensors under checkpoint names
    for e in range(8):
        I = full.moe.intermediate_size
        gu, down = block.experts.gate_up_proj[e], block.experts.down_proj[e]
        ckpt[f"model.layers.1.mlp.experts.{e}.gate_proj.weight"] = gu[:I]
        ckpt[f"model.layers.1.mlp.experts.{e}.up_proj.weight"] = gu[I:]
        ckpt[f"model.layers.1.mlp.experts.{e}.down_proj.weight"] = down
    x = torch.randn(5, 64)
    want = block(x)
    for tp, ep in ((2, False), (4, False), (2, True), (4, True)):
        total = torch.zeros_like(want)
        for r in range(tp):
            lay = TPLayout(r, tp, full, expert_parallel=ep)
            local = lay.local_arch()
            part = SparseMoE(local, torch.float32)
            sd = {"gate.weight": block.gate.weight, "gate.e_score_correction_bias": block.gate.e_score_correction_bias}
            for frag in ("gate_proj", "up_proj", "down_proj"):
                w = dict(zip(("gate_proj", "up_proj"), block.shared_experts.gate_up_proj.weight.chunk(2)))
                w["down_proj"] = block.shared_experts.down_proj.weight
                sd[f"shared.{frag}"] = lay.shard_tensor(f"model.layers.1.mlp.shared_experts.{frag}.weight", w[frag])
            with torch.no_grad():
                part.gate.weight.copy_(sd["gate.weight"])
                part.gate.e_score_correction_bias.copy_(sd["gate.e_score_correction_bias"])
                part.shared_experts.gate_up_proj.weight.copy_(torch.cat([sd["shared.gate_proj"], sd["shared.up_proj"]]))
                part.shared_experts.down_proj.weight.copy_(sd["shared.down_proj"])
                for e in lay.experts:
                    le, Il = e - lay.experts.start, local.moe.intermediate_size
                    sl = {f: lay.shard_tensor(f"model.layers.1.mlp.experts.{e}.{f}.weight",
                                              ckpt[f"model.layers.1.mlp.experts.{e}.{f}.weight"])
                          for f in ("gate_proj", "up_proj", "down_proj")}
                    part.experts.gate_up_proj[le, :Il] = sl["gate_proj"]
                    part.experts.gate_up_proj[le, Il:] = sl["up_proj"]
                    part.experts.down_proj[le] = sl["down_proj"]
            total += part(x)
        torch.testing.assert_close(total, want, rtol=1e-5, atol=1e-5, msg=f"tp={tp} expert_parallel={ep}")


def test_degrees_that_do_not_divide_are_named():
    six = parse_arch_config(_hf_dict({**DEEPSEEK, "num_attention_heads": 6, "num_key_value_heads": 6},
                                     "DeepseekV3ForCausalLM"))
    with pytest.raises(TensorParallelError, match="expert parallelism needs the 8 routed experts .* divide by 3"):
        TPLayout(0, 3, six, expert_parallel=True)
    ds = parse_arch_config(_hf_dict(DEEPSEEK, "DeepseekV3ForCausalLM"))
    with pytest.raises(TensorParallelError, match="num_attention_heads=4"):
        TPLayout(0, 8, ds)
    q = parse_arch_config(_hf_dict({**QWEN, "num_attention_heads": 8, "num_key_value_heads": 4,
                                    "moe_intermediate_size": 36}, "Qwen3MoeForCausalLM"))
    with pytest.raises(TensorParallelError, match="moe_intermediate_size=36"):
        TPLayout(0, 8, q)
