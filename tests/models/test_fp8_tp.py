"""Tensor parallelism on FP8 checkpoints: TP2 (rank 1 a real follower process over gloo) gives
TP1's logits and greedy tokens for the FP8 DeepSeek-V3 and Qwen3-MoE (conftest fp8_models), every
rank holding its slice of the FP8 weights and the matching rows / columns of the scales."""

from __future__ import annotations

import pytest
import torch

from test_moe_tp import GREEDY, PROMPTS, _engine, _first_logits


@pytest.mark.parametrize("family", ["deepseek_v3", "qwen3_moe"])
def test_fp8_tp2_matches_tp1(family, fp8_models):
    _, _, folder = fp8_models[family]
    one, two = _engine(folder, 1), _engine(folder, 2)
    try:
        torch.testing.assert_close(_first_logits(two, PROMPTS[0]), _first_logits(one, PROMPTS[0]),
                                   rtol=1e-4, atol=1e-4)
        ref = [o.output_token_ids for o in one.generate(PROMPTS, GREEDY)]
        assert [o.output_token_ids for o in two.generate(PROMPTS, GREEDY)] == ref
        m = two.loaded.model
        experts = m.model.layers[1].mlp.experts
        assert experts.gate_up_proj.dtype == torch.float8_e4m3fn
        assert experts.gate_up_proj.shape == (8, 256, 256)  # 128 gate + 128 up rows of each expert
        assert experts.gate_up_proj_scale_inv.shape == (8, 2, 2)
        assert experts.down_proj_scale_inv.shape == (8, 2, 1)  # this rank's 128 input columns
        assert two.allocator.num_free == two.allocator.num_total
    finally:
        two.close()


def test_fp8_expert_parallel_tp2_matches_tp1(fp8_models):
    """parallel.expert_parallel: each rank holds 4 of the 8 FP8 experts whole (and their scales);
    the sum over ranks is TP1's."""
    from pdkv.config import KVCacheConfig, ModelConfig, ParallelConfig, SchedulerConfig
    from pdkv.engine import LLMEngine

    _, _, folder = fp8_models["qwen3_moe"]
    one = _engine(folder, 1)
    two = LLMEngine(ModelConfig(path=str(folder)), KVCacheConfig(page_size=4, num_pages=96),
                    SchedulerConfig(max_num_batched_tokens=24, chunk_size=8, max_num_seqs=4),
                    parallel=ParallelConfig(tp=2, timeout_s=30.0, startup_timeout_s=120.0, expert_parallel=True))
    try:
        experts = two.loaded.model.model.layers[1].mlp.experts
        assert experts.gate_up_proj.shape == (4, 512, 256) and experts.gate_up_proj_scale_inv.shape == (4, 4, 2)
        torch.testing.assert_close(_first_logits(two, PROMPTS[0]), _first_logits(one, PROMPTS[0]),
                                   rtol=1e-4, atol=1e-4)
        ref = [o.output_token_ids for o in one.generate(PROMPTS, GREEDY)]
        assert [o.output_token_ids for o in two.generate(PROMPTS, GREEDY)] == ref
    finally:
        two.close()
