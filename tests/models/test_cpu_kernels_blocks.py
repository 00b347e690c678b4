"""pdkv's fused CPU kernels (pdkv/kernels/mlp.c, route.c, norm.c, rope.c) against torch's own
ops, which they replace in models/layers.py and models/moe.py:
- the gated MLP for 1-16 rows, widths off the vector blocks;
- the one-token MoE step: its k experts in ascending order whatever order routing gives, only
  this rank's under expert parallelism, zeros when none is, an expert id out of range refused;
- routing, softmax and DeepSeek's sigmoid with groups, correction bias, renormalisation and
  scaling: the same experts as the torch Router picks, weights to float32 rounding;
- RMSNorm of 2-D rows and strided 3-D head views, and norm + rope of q/k heads."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from pdkv.models import cpu_kernels
from pdkv.models.rope import apply_rope

pytestmark = [pytest.mark.skipif(not cpu_kernels.AVAILABLE, reason="pdkv._kernels is not built or the CPU lacks AVX2+FMA"),
              pytest.mark.usefixtures("one_torch_thread")]


def _close(a, ref, tol=1e-5):
    return ((a.double() - ref.double()).abs().max() / ref.double().abs().max().clamp_min(1e-30)).item() < tol


@pytest.mark.parametrize("m", [1, 2, 5, 16])
@pytest.mark.parametrize("h, inter", [(64, 96), (40, 13)])
def test_gated_mlp(m, h, inter):
    g = torch.Generator().manual_seed(m + h)
    x, gu, down = torch.randn(m, h, generator=g), torch.randn(2 * inter, h, generator=g), torch.randn(h, inter, generator=g)
    with torch.inference_mode():
        y = cpu_kernels.gated_mlp(x, gu, down, inter)
    xd, gud, dd = x.double(), gu.double(), down.double()
    a = xd @ gud.T
    ref = (F.silu(a[:, :inter]) * a[:, inter:]) @ dd.T
    assert y.shape == (m, h) and _close(y, ref)


def _experts(n, h, inter, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 2 * inter, h, generator=g) * 0.3, torch.randn(n, h, inter, generator=g) * 0.3


def _expert_ref(x, gu, down, e):
    a = x.double() @ gu[e].double().T
    return (F.silu(a[:, :gu.shape[1] // 2]) * a[:, gu.shape[1] // 2:]) @ down[e].double().T


def test_moe_one_token_sums_its_experts_in_ascending_order():
    h, inter, n = 48, 24, 8
    gu, down = _experts(n, h, inter)
    x = torch.randn(1, h)
    ids, w = torch.tensor([[6, 1, 3]]), torch.tensor([[0.5, 0.3, 0.2]])
    with torch.inference_mode():
        out = cpu_kernels.moe_one_token(x, gu, down, ids, w, n, 0)
        # the same experts given in another order: the same bits (the kernel sorts them)
        again = cpu_kernels.moe_one_token(x, gu, down, torch.tensor([[1, 3, 6]]), torch.tensor([[0.3, 0.2, 0.5]]), n, 0)
    ref = sum(wt * _expert_ref(x, gu, down, e) for e, wt in zip(ids[0].tolist(), w[0].tolist()))
    assert _close(out, ref)
    assert torch.equal(out, again)
    # bit for bit what the per-expert kernel MLP, torch's multiply and ascending adds give
    with torch.inference_mode():
        parts = [cpu_kernels.gated_mlp(x, gu[e], down[e], inter) * wt for e, wt in ((1, 0.3), (3, 0.2), (6, 0.5))]
    assert torch.equal(out, parts[0] + parts[1] + parts[2])


def test_moe_one_token_under_expert_parallelism():
    """This rank holds global experts 4..7: the pairs routed to 0..3 are another rank's."""
    h, inter = 32, 16
    gu, down = _experts(4, h, inter, seed=1)
    x = torch.randn(1, h)
    with torch.inference_mode():
        out = cpu_kernels.moe_one_token(x, gu, down, torch.tensor([[5, 2, 7]]), torch.tensor([[0.4, 0.35, 0.25]]), 8, 4)
        none = cpu_kernels.moe_one_token(x, gu, down, torch.tensor([[0, 2]]), torch.tensor([[0.5, 0.5]]), 8, 4)
    ref = 0.4 * _expert_ref(x, gu, down, 1) + 0.25 * _expert_ref(x, gu, down, 3)
    assert _close(out, ref)
    assert torch.equal(none, torch.zeros(1, h))
    with pytest.raises(ValueError, match="expert id outside"):
        cpu_kernels.moe_one_token(x, gu, down, torch.tensor([[8]]), torch.tensor([[1.0]]), 8, 4)
    with pytest.raises(ValueError, match="expert id outside"):
        cpu_kernels.moe_one_token(x, gu, down, torch.tensor([[-1]]), torch.tensor([[1.0]]), 8, 4)
    # what the kernel does not take (two rows, a bf16 x) is left to the caller's loop
    assert cpu_kernels.moe_one_token(torch.randn(2, h), gu, down, torch.tensor([[5]]), torch.tensor([[1.0]]), 8, 4) is None
    assert cpu_kernels.moe_one_token(x.bfloat16(), gu, down, torch.tensor([[5]]), torch.tensor([[1.0]]), 8, 4) is None


@dataclasses.dataclass
class _MoE:  # the fields of models.config_moe's MoE config that routing reads
    num_experts: int
    top_k: int
    norm_topk_prob: bool
    scoring: str = "softmax"
    num_groups: int = 1
    topk_groups: int = 1
    routed_scaling_factor: float = 1.0
    correction_bias: bool = False


ROUTINGS = {
    "softmax": _MoE(16, 4, True),
    "softmax_raw": _MoE(10, 3, False),
    "sigmoid_groups_bias": _MoE(32, 4, True, "sigmoid", 4, 2, 2.5, True),
    "sigmoid_one_group": _MoE(12, 3, False, "sigmoid", 1, 1, 1.5, False),
}


@pytest.mark.parametrize("case", list(ROUTINGS))
def test_route_matches_torch_router(case):
    from pdkv.models.moe import Router

    m = ROUTINGS[case]
    r = Router.__new__(Router)
    torch.nn.Module.__init__(r)
    r.moe = m
    g = torch.Generator().manual_seed(7)
    r.weight = torch.nn.Parameter(torch.randn(m.num_experts, 24, generator=g))
    if m.correction_bias:
        r.e_score_correction_bias = torch.nn.Parameter(torch.randn(m.num_experts, generator=g) * 0.1)
    x = torch.randn(9, 24, generator=g)
    with torch.inference_mode():
        r.cpu_kernel = True
        ids, w = r.forward(x)
        r.cpu_kernel = False
        ref_ids, ref_w = r.forward(x)
    assert ids.dtype == torch.long and w.dtype == torch.float32 and ids.shape == w.shape == (9, m.top_k)
    assert torch.equal(ids, ref_ids)  # both in descending order of the selection score
    assert _close(w, ref_w, 1e-6)


def test_route_refuses_shapes_it_does_not_take():
    logits = torch.randn(2, 12)
    with pytest.raises(ValueError, match="not a shape the kernel takes"):  # 5 groups do not divide 12 experts
        cpu_kernels.route(logits, _MoE(12, 2, True, "sigmoid", 5, 2), None)
    assert cpu_kernels.route(logits, _MoE(13, 2, True), None) is None  # logits of another width: torch's path
    assert cpu_kernels.route(logits.double(), _MoE(12, 2, True), None) is None


def test_rms_norm_rows_and_head_views():
    g = torch.Generator().manual_seed(8)
    w2, w3 = torch.randn(40, generator=g), torch.randn(16, generator=g)
    x2 = torch.randn(5, 40, generator=g)
    wide = torch.randn(3, 100, generator=g)
    x3 = wide[:, 4:68].view(3, 4, 16)  # 4 heads of 16 inside rows of 100: a strided view
    with torch.inference_mode():
        assert _close(cpu_kernels.rms_norm(x2, w2, 1e-6), F.rms_norm(x2.double(), (40,), w2.double(), 1e-6))
        y3 = cpu_kernels.rms_norm(x3, w3, 1e-5)
    assert y3.is_contiguous() and _close(y3, F.rms_norm(x3.double(), (16,), w3.double(), 1e-5))
    assert cpu_kernels.rms_norm(x2.bfloat16(), w2.bfloat16(), 1e-6) is None


@pytest.mark.parametrize("norm", [False, True])
def test_norm_rope_matches_apply_rope(norm):
    from pdkv.models.rope import RotaryEmbedding

    T, H, D = 3, 6, 32
    rot = RotaryEmbedding(D, 64, 10000.0, {})
    cos, sin = rot.table(torch.tensor([0, 17, 63]), torch.float32)
    g = torch.Generator().manual_seed(9)
    qkv = torch.randn(T, H * D + 40, generator=g)  # heads inside wider rows, as a qkv projection's output
    x = qkv[:, :H * D].view(T, H, D)
    w = torch.randn(D, generator=g) if norm else None
    with torch.inference_mode():
        out = cpu_kernels.norm_rope(x, w, 1e-6, cos, sin)
    ref_in = F.rms_norm(x.double(), (D,), w.double(), 1e-6) if norm else x.double()
    assert _close(out, apply_rope(ref_in, cos.double(), sin.double()))
    assert cpu_kernels.norm_rope(x, w, 1e-6, cos[:2], sin[:2]) is None  # tables for other rows: torch's path


@pytest.mark.parametrize("q_lora", [24, None])
def test_mla_decode_kernel_equals_torch_path(q_lora):
    """An MLA layer's decode step (B = 1 and 3) through pdkv/kernels/mla_decode.c and through the
    torch ops of models/mla.py: the same outputs to float32 rounding and the same latents stored."""
    from pdkv.models.attention.base import AttentionBatch
    from pdkv.models.config import parse_arch_config
    from pdkv.models.kv_layout import kv_layout
    from pdkv.models.mla import MLAttention
    from pdkv.models.rope import RotaryEmbedding

    kw = dict(hidden_size=64, intermediate_size=96, moe_intermediate_size=32, vocab_size=512,
              max_position_embeddings=256, kv_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16,
              n_routed_experts=8, num_experts_per_tok=2, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=4, q_lora_rank=q_lora, n_group=1, topk_group=1)
    cfg = parse_arch_config({"architectures": ["DeepseekV3ForCausalLM"], "model_type": "x", **kw})
    torch.manual_seed(0)
    attn = MLAttention(cfg, torch.float32)
    with torch.no_grad():
        for name, p in attn.named_parameters():
            p.copy_(1 + 0.1 * torch.randn_like(p) if "norm" in name else 0.2 * torch.randn_like(p))
    attn.post_load()
    lay = kv_layout(cfg)
    kv = lay.make_cache(1, 30, 16, torch.float32, "HND", "cpu")
    kv.layer(0).normal_()
    backend = lay.make_backend("torch", kv)
    rot = RotaryEmbedding(8, 256, 10000.0, {})
    tables, lens = [[4, 9, 2], [20], [7, 1, 17, 22]], [40, 5, 60]
    for B in (1, 3):
        meta = backend.plan(AttentionBatch([1] * B, lens[:B], tables[:B], B))
        assert meta.decode_lens is not None
        cos, sin = rot.table(torch.tensor(lens[:B]) - 1, torch.float32)
        x = torch.randn(B, 64, generator=torch.Generator().manual_seed(B))
        outs, caches, before = [], [], kv.layer(0).clone()
        for use in (True, False):
            attn.cpu_kernel = use
            with torch.inference_mode():
                outs.append(attn.forward(0, x, cos, sin, backend, meta))
            caches.append(kv.layer(0).clone())
            kv.layer(0).copy_(before)
        assert _close(outs[0], outs[1])
        assert _close(caches[0], caches[1]) and not torch.equal(caches[0], before)
    # a new latent's slot outside the cache: refused by name, nothing stored
    bad = dataclasses.replace(meta, write_pages=torch.full((3,), 30, dtype=torch.long))
    before = kv.layer(0).clone()
    attn.cpu_kernel = True
    with torch.inference_mode(), pytest.raises(ValueError, match="MLA decode: .*out of range"):
        attn.forward(0, x, cos, sin, backend, bad)
    assert torch.equal(kv.layer(0), before)
