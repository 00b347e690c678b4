"""The parts of a Hugging Face ``config.json`` the model families use, as one frozen dataclass.

Both spellings of rope settings are read: ``rope_theta`` + ``rope_scaling`` (transformers 4.x
folders, most published checkpoints) and ``rope_parameters`` (transformers 5.x ``save_pretrained``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pdkv.models.config_moe import MLAConfig, MoEConfig, parse_mla, parse_moe
from pdkv.errors import ModelLoadError


@dataclass(frozen=True)
class ArchConfig:
    architecture: str
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict = field(default_factory=dict)  # {"rope_type": "llama3", "factor": ...} or {}
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # bias on q/k/v projections (always on for Qwen2)
    o_bias: bool = False  # bias on o_proj (Llama's attention_bias covers o_proj too)
    mlp_bias: bool = False
    qk_norm: bool = False  # Qwen3: RMSNorm over head_dim on q and k before rope
    sliding_window: int | None = None  # Mistral: keys older than this many positions are masked
    hidden_act: str = "silu"
    eos_token_id: tuple[int, ...] = ()
    bos_token_id: int | None = None
    moe: MoEConfig | None = None  # routed experts (Qwen3-MoE, DeepSeek-V3): models/config_moe.py
    mla: MLAConfig | None = None  # multi-head latent attention (DeepSeek-V3)
    # DeepSeek-V3-style multi-token-prediction layers stored after the decoder layers
    # (model.layers.{num_layers}...): loaded by pdkv/engine/spec/mtp.py, skipped by the target.
    num_nextn_predict_layers: int = 0

    def is_moe_layer(self, layer: int) -> bool:
        return self.moe is not None and layer in self.moe.sparse_layers

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim


def _req(cfg: dict, key: str, source: str) -> Any:
    if key not in cfg or cfg[key] is None:
        raise ModelLoadError(f"{source}: missing required field '{key}'")
    return cfg[key]


def _rope(cfg: dict) -> tuple[float, dict]:
    """Returns (theta, scaling dict without theta/type 'default')."""
    params = cfg.get("rope_parameters")
    if isinstance(params, dict) and "rope_theta" in params:
        theta = float(params["rope_theta"])
        scaling = {k: v for k, v in params.items() if k != "rope_theta"}
    else:
        theta = float(cfg.get("rope_theta", 10000.0))
        scaling = dict(cfg.get("rope_scaling") or {})
    if "type" in scaling and "rope_type" not in scaling:
        scaling["rope_type"] = scaling.pop("type")
    if scaling.get("rope_type", "default") == "default":
        scaling = {}
    return theta, scaling


def parse_arch_config(cfg: dict, source: str = "config.json") -> ArchConfig:
    """Builds an ArchConfig from a config.json dict; errors name ``source`` and the field."""
    archs = cfg.get("architectures") or []
    if not archs:
        raise ModelLoadError(f"{source}: missing 'architectures' (e.g. [\"LlamaForCausalLM\"])")
    arch = archs[0]
    hidden = int(_req(cfg, "hidden_size", source))
    heads = int(_req(cfg, "num_attention_heads", source))
    kv_heads = int(cfg.get("num_key_value_heads") or heads)
    if hidden <= 0 or heads <= 0 or kv_heads <= 0 or heads % kv_heads:
        raise ModelLoadError(f"{source}: num_attention_heads={heads} must be a positive multiple "
                             f"of num_key_value_heads={kv_heads}")
    head_dim = int(cfg.get("head_dim") or hidden // heads)
    num_layers = int(_req(cfg, "num_hidden_layers", source))
    mla = parse_mla(cfg, arch, source)
    if mla is not None:
        head_dim = mla.qk_rope_head_dim  # the only rotated part: what the rope table is built for
    theta, scaling = _rope(cfg)
    model_type = cfg.get("model_type", "")
    eos = cfg.get("eos_token_id")
    eos = tuple(eos) if isinstance(eos, list) else ((int(eos),) if eos is not None else ())
    attention_bias = bool(cfg.get("attention_bias", False))
    is_qwen2 = arch == "Qwen2ForCausalLM"
    sliding = cfg.get("sliding_window")
    if is_qwen2 or model_type.startswith("qwen"):
        # Qwen configs carry sliding_window but only apply it with use_sliding_window, and then
        # only from layer max_window_layers on; one window for every layer is all we implement.
        if cfg.get("use_sliding_window", False):
            if int(cfg.get("max_window_layers") or 0) != 0:
                raise ModelLoadError(f"{source}: use_sliding_window with max_window_layers="
                                     f"{cfg.get('max_window_layers')} (sliding window on some layers "
                                     "only) is not supported")
        else:
            sliding = None
    return ArchConfig(
        architecture=arch,
        model_type=model_type,
        vocab_size=int(_req(cfg, "vocab_size", source)),
        hidden_size=hidden,
        intermediate_size=int(_req(cfg, "intermediate_size", source)),
        num_layers=num_layers,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        max_position_embeddings=int(cfg.get("max_position_embeddings") or 2048),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        rope_scaling=scaling,
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        attention_bias=attention_bias or is_qwen2,
        o_bias=attention_bias and not is_qwen2,
        mlp_bias=bool(cfg.get("mlp_bias", False)),
        qk_norm=arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM"),
        sliding_window=int(sliding) if sliding else None,
        hidden_act=cfg.get("hidden_act", "silu"),
        eos_token_id=eos,
        bos_token_id=cfg.get("bos_token_id"),
        moe=parse_moe(cfg, arch, num_layers, source),
        mla=mla,
        num_nextn_predict_layers=int(cfg.get("num_nextn_predict_layers") or 0),
    )
