"""The split itself, without processes: which rows and columns of each checkpoint tensor a rank
holds, and that the ranks' partial products sum to the one-rank result (what the all-reduce
computes), including with replicated KV heads and a bias on the row-parallel output."""

from __future__ import annotations

import pytest
import torch

from pdkv.models.config import ArchConfig
from pdkv.models.parallel import TensorParallelError, TPLayout


def _arch(heads=8, kv_heads=2, inter=24, head_dim=4) -> ArchConfig:
    return ArchConfig("LlamaForCausalLM", "llama", 64, heads * head_dim, inter, 2, heads, kv_heads, head_dim, 128)


@pytest.mark.parametrize("tp,kv_heads", [(2, 2), (4, 2), (8, 2), (2, 1), (4, 4)])
def test_heads_follow_the_shard_planner_and_gqa(tp, kv_heads):
    a = _arch(heads=8, kv_heads=kv_heads)
    group = a.num_heads // a.num_kv_heads
    held = []
    for r in range(tp):
        lay = TPLayout(r, tp, a)
        # Every query head of the rank reads a KV head the rank holds.
        assert {q // group for q in lay.q_heads} <= set(lay.kv_heads)
        assert lay.local_arch().num_kv_heads == max(1, kv_heads // tp)
        held.extend(lay.kv_heads)
    assert sorted(set(held)) == list(range(kv_heads))  # every head on some rank
    assert len(held) == max(tp, kv_heads)  # replicated tp / kv_heads times when fewer heads than ranks


def test_partial_products_sum_to_full():
    torch.manual_seed(0)
    a, tp = _arch(heads=8, kv_heads=2), 4
    H, D = a.hidden_size, a.head_dim
    x = torch.randn(3, H)
    w = {n: torch.randn(rows, cols) for n, rows, cols in [
        ("l.self_attn.q_proj.weight", a.num_heads * D, H), ("l.self_attn.k_proj.weight", a.num_kv_heads * D, H),
        ("l.self_attn.o_proj.weight", H, a.num_heads * D), ("l.mlp.up_proj.weight", a.intermediate_size, H),
        ("l.mlp.down_proj.weight", H, a.intermediate_size)]}
    o_bias = torch.randn(H)
    attn_in = torch.randn(3, a.num_heads * D)  # stands for the attention output, heads in order
    full_o = attn_in @ w["l.self_attn.o_proj.weight"].T + o_bias
    full_mlp = (x @ w["l.mlp.up_proj.weight"].T) @ w["l.mlp.down_proj.weight"].T
    sum_o, sum_mlp = torch.zeros_like(full_o), torch.zeros_like(full_mlp)
    for r in range(tp):
        lay = TPLayout(r, tp, a)
        q = lay.q_heads
        o = lay.shard_tensor("l.self_attn.o_proj.weight", w["l.self_attn.o_proj.weight"])
        sum_o += attn_in[:, q.start * D:q.stop * D] @ o.T + lay.shard_tensor("l.self_attn.o_proj.bias", o_bias)
        up = lay.shard_tensor("l.mlp.up_proj.weight", w["l.mlp.up_proj.weight"])
        down = lay.shard_tensor("l.mlp.down_proj.weight", w["l.mlp.down_proj.weight"])
        sum_mlp += (x @ up.T) @ down.T
        k = lay.shard_tensor("l.self_attn.k_proj.weight", w["l.self_attn.k_proj.weight"])
        h = lay.kv_heads
        assert torch.equal(k, w["l.self_attn.k_proj.weight"][h.start * D:h.stop * D])
    torch.testing.assert_close(sum_o, full_o)
    torch.testing.assert_close(sum_mlp, full_mlp)


def test_bad_splits_and_shapes_name_the_problem():
    with pytest.raises(TensorParallelError, match="must divide num_attention_heads=8"):
        TPLayout(0, 3, _arch())
    with pytest.raises(TensorParallelError, match="cannot replicate 3 KV heads"):
        TPLayout(0, 4, _arch(heads=12, kv_heads=3, inter=24))
    with pytest.raises(ValueError, match="'m.q_proj.weight' has shape \\(30, 32\\)"):
        TPLayout(0, 2, _arch()).shard_tensor("m.q_proj.weight", torch.zeros(30, 32))
