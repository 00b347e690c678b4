"""The mixture-of-experts and multi-head latent attention fields of a ``config.json``.

Both families' spellings are read: Qwen3-MoE (``num_experts`` — or ``num_local_experts`` as
transformers 5.x ``save_pretrained`` writes it — ``decoder_sparse_step``, ``mlp_only_layers``,
softmax routing) and DeepSeek-V3 (``n_routed_experts``, ``n_group``/``topk_group`` grouped
top-k over sigmoid scores with ``e_score_correction_bias``, ``n_shared_experts``,
``first_k_dense_replace``). Every inconsistency is refused here, naming the field, before any
tensor is built.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pdkv.errors import ModelLoadError


@dataclass(frozen=True)
class MoEConfig:
    num_experts: int  # routed experts (global, whatever this rank holds)
    top_k: int  # experts per token
    intermediate_size: int  # of one routed expert (moe_intermediate_size)
    sparse_layers: tuple[int, ...]  # decoder layers whose MLP is the MoE block
    norm_topk_prob: bool
    scoring: str = "softmax"  # "softmax" (Qwen3-MoE) or "sigmoid" (DeepSeek-V3)
    num_groups: int = 1  # n_group: experts split into groups, top groups chosen first
    topk_groups: int = 1  # topk_group
    routed_scaling_factor: float = 1.0
    num_shared_experts: int = 0  # one shared MLP of n_shared * intermediate_size, every token
    correction_bias: bool = False  # e_score_correction_bias: added for selection only
    # Tensor parallelism (models/parallel.py): with expert parallelism this rank holds routed
    # experts [expert_start, expert_start + num_local_experts); otherwise all of them, each with
    # intermediate_size / tp rows.
    expert_start: int = 0
    num_local_experts: int | None = None
    shared_size: int | None = None  # this rank's width of the shared MLP, when split


    @property
    def local_experts(self) -> range:
        n = self.num_experts if self.num_local_experts is None else self.num_local_experts
        return range(self.expert_start, self.expert_start + n)

    @property
    def shared_intermediate_size(self) -> int:
        if self.shared_size is not None:
            return self.shared_size
        return self.num_shared_experts * self.intermediate_size


@dataclass(frozen=True)
class MLAConfig:
    q_lora_rank: int | None  # None: a plain q_proj
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope_interleave: bool = True  # DeepSeek's checkpoints store the rope dims as (x0, x1) pairs

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_dim(self) -> int:
        """Values cached per token and layer: the normalised compressed KV and the rope key."""
        return self.kv_lora_rank + self.qk_rope_head_dim


def _int(cfg: dict, key: str, source: str, minimum: int = 1, default: Any = None) -> int:
    value = cfg.get(key, default)
    if value is None:
        raise ModelLoadError(f"{source}: missing required field '{key}'")
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ModelLoadError(f"{source}: {key} must be an integer >= {minimum}, got {value!r}")
    return value


def parse_moe(cfg: dict, arch: str, num_layers: int, source: str) -> MoEConfig | None:
    """The MoE block of Qwen3-MoE or DeepSeek-V3; None for the dense families."""
    if arch == "Qwen3MoeForCausalLM":
        key = "num_experts" if "num_experts" in cfg else "num_local_experts"
        num_experts = _int(cfg, key, source, minimum=0)
        step = _int(cfg, "decoder_sparse_step", source, default=1)
        only = cfg.get("mlp_only_layers") or []
        if not isinstance(only, list) or any(not isinstance(i, int) or not 0 <= i < num_layers for i in only):
            raise ModelLoadError(f"{source}: mlp_only_layers must list layer indices in "
                                 f"[0, {num_layers}), got {only!r}")
        sparse = tuple(i for i in range(num_layers)
                       if i not in only and num_experts > 0 and (i + 1) % step == 0)
        if not sparse:
            return None
        moe = MoEConfig(num_experts, _int(cfg, "num_experts_per_tok", source),
                        _int(cfg, "moe_intermediate_size", source), sparse,
                        bool(cfg.get("norm_topk_prob", False)))
    elif arch == "DeepseekV3ForCausalLM":
        scoring = cfg.get("scoring_func", "sigmoid")
        if scoring != "sigmoid":
            raise ModelLoadError(f"{source}: scoring_func must be 'sigmoid' for DeepseekV3ForCausalLM, "
                                 f"got {scoring!r}")
        first_dense = _int(cfg, "first_k_dense_replace", source, minimum=0, default=0)
        key = "n_routed_experts" if "n_routed_experts" in cfg else "num_local_experts"
        moe = MoEConfig(_int(cfg, key, source), _int(cfg, "num_experts_per_tok", source),
                        _int(cfg, "moe_intermediate_size", source), tuple(range(first_dense, num_layers)),
                        bool(cfg.get("norm_topk_prob", True)), "sigmoid",
                        _int(cfg, "n_group", source, default=1), _int(cfg, "topk_group", source, default=1),
                        float(cfg.get("routed_scaling_factor", 1.0)),
                        _int(cfg, "n_shared_experts", source, minimum=0, default=0), correction_bias=True)
        if not moe.sparse_layers:
            return None
    else:
        return None
    _check_routing(moe, source)
    return moe


def _check_routing(m: MoEConfig, source: str) -> None:
    if m.top_k > m.num_experts:
        raise ModelLoadError(f"{source}: num_experts_per_tok={m.top_k} exceeds the {m.num_experts} "
                             "routed experts")
    if m.num_experts % m.num_groups:
        raise ModelLoadError(f"{source}: n_group={m.num_groups} must divide the {m.num_experts} routed experts")
    if m.topk_groups > m.num_groups:
        raise ModelLoadError(f"{source}: topk_group={m.topk_groups} exceeds n_group={m.num_groups}")
    per_group = m.num_experts // m.num_groups
    if m.num_groups > 1 and per_group < 2:
        raise ModelLoadError(f"{source}: n_group={m.num_groups} leaves {per_group} expert per group; "
                             "a group's score is the sum of its top 2 experts")
    if m.top_k > m.topk_groups * per_group:
        raise ModelLoadError(f"{source}: num_experts_per_tok={m.top_k} exceeds the "
                             f"{m.topk_groups * per_group} experts of the topk_group={m.topk_groups} "
                             "groups a token may use")


def parse_mla(cfg: dict, arch: str, source: str) -> MLAConfig | None:
    if arch != "DeepseekV3ForCausalLM":
        return None
    q_lora = cfg.get("q_lora_rank")
    if q_lora is not None:
        q_lora = _int(cfg, "q_lora_rank", source)
    mla = MLAConfig(q_lora, _int(cfg, "kv_lora_rank", source), _int(cfg, "qk_nope_head_dim", source),
                    _int(cfg, "qk_rope_head_dim", source), _int(cfg, "v_head_dim", source),
                    bool(cfg.get("rope_interleave", True)))
    if mla.qk_rope_head_dim % 2:
        raise ModelLoadError(f"{source}: qk_rope_head_dim must be even (rope rotates pairs), "
                             f"got {mla.qk_rope_head_dim}")
    return mla
