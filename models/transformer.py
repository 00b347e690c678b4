"""A decoder-only GQA causal LM over a paged KV cache: what Llama, Mistral, Qwen2 and Qwen3
share. Family files subclass it and say only what differs.

``forward`` takes the step's tokens flattened across sequences and returns hidden states;
``compute_logits`` runs the LM head on the few rows that are sampled.
"""

from __future__ import annotations

import torch
from torch import nn

from pdkv.models.config import ArchConfig
from pdkv.models.cpu_kernels import linear
from pdkv.models.layers import MLP, Attention, DecoderLayer, RMSNorm
from pdkv.models.moe import SparseMoE, expected_expert_tensors, expert_param_for, is_remote_expert
from pdkv.models.rope import RotaryEmbedding


class _Body(nn.Module):
    """``model.*`` in Hugging Face naming: embeddings, layers, final norm."""

    def __init__(self, cfg: ArchConfig, dtype: torch.dtype, attention_cls):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size, dtype=dtype)
        self.layers = nn.ModuleList(
            DecoderLayer(cfg, dtype, attention_cls, SparseMoE(cfg, dtype) if cfg.is_moe_layer(i) else MLP(cfg, dtype))
            for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)


class CausalLM(nn.Module):
    attention_cls = Attention
    # checkpoint name fragment → (fused parameter fragment, which slice of the fused rows)
    STACKED = {
        ".q_proj.": (".qkv_proj.", "q"), ".k_proj.": (".qkv_proj.", "k"), ".v_proj.": (".qkv_proj.", "v"),
        ".gate_proj.": (".gate_up_proj.", "gate"), ".up_proj.": (".gate_up_proj.", "up"),
    }

    def __init__(self, cfg: ArchConfig, dtype: torch.dtype):
        super().__init__()
        self.cfg = cfg
        self.model = _Body(cfg, dtype, self.attention_cls)
        self.lm_head = None if cfg.tie_word_embeddings else nn.Linear(cfg.hidden_size, cfg.vocab_size,
                                                                      bias=False, dtype=dtype)
        self.rotary: RotaryEmbedding | None = None  # built by init_rope() on the final device

    def init_rope(self, max_positions: int, device) -> None:
        c = self.cfg
        self.rotary = RotaryEmbedding(c.head_dim, max_positions, c.rope_theta, c.rope_scaling).to(device)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, backend, meta, hook=None) -> torch.Tensor:
        """input_ids, positions: [T] long → hidden states [T, H] (after the final norm)."""
        x = self.model.embed_tokens(input_ids)
        cos, sin = self.rotary.table(positions, x.dtype)
        for i, layer in enumerate(self.model.layers):
            x = layer.forward(i, x, cos, sin, backend, meta, hook)  # see models/layers.py NOTE
        return self.model.norm.forward(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [N, H] → logits [N, vocab] float32."""
        weight = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        # A tied head reads the embedding table, whose [vocab, H] rows the loader cannot lay out
        # for MKL: with model.cpu_kernels off it must not reach pdkv's kernel by its layout.
        return (linear if self.cpu_kernel else torch.nn.functional.linear)(hidden, weight).float()

    cpu_kernel = True  # False: the loader laid the weights out for torch's GEMMs (model.cpu_kernels)

    # ---- loading ---------------------------------------------------------------------------
    def param_for(self, name: str) -> tuple[str, slice | tuple | None]:
        """Maps a checkpoint tensor name to (our parameter name, rows of it) or raises KeyError."""
        if self.cfg.moe is not None:
            expert = expert_param_for(self.cfg, name)  # mlp.experts.E.* → the fused experts' rows
            if expert is not None:
                return expert
        for frag, (fused, part) in self.STACKED.items():
            if frag in name:
                c = self.cfg
                if fused == ".qkv_proj.":
                    bounds = {"q": (0, c.q_size), "k": (c.q_size, c.q_size + c.kv_size),
                              "v": (c.q_size + c.kv_size, c.q_size + 2 * c.kv_size)}[part]
                else:  # the MLP's own width: dense, or a MoE layer's shared experts
                    pname = name.replace(frag, fused)
                    try:
                        inter = self.get_submodule(pname[:pname.index(fused)]).inter
                    except AttributeError:  # no such module: the loader reports the unexpected tensor
                        return pname, None
                    bounds = {"gate": (0, inter), "up": (inter, 2 * inter)}[part]
                return name.replace(frag, fused), slice(*bounds)
        return name, None

    def is_ignorable(self, name: str) -> bool:
        """Checkpoint tensors we do not need: rope caches, a tied head saved anyway."""
        if self.cfg.num_nextn_predict_layers and name.startswith("model.layers."):
            if int(name.split(".")[2]) >= self.cfg.num_layers:  # an MTP layer (pdkv/engine/spec/mtp.py)
                return True
        return ("rotary_emb" in name or (self.lm_head is None and name == "lm_head.weight")
                or (self.cfg.moe is not None and is_remote_expert(self.cfg, name)))

    def expected_tensors(self) -> set[str]:
        """Checkpoint names that must be present (one per parameter row block)."""
        names = set()
        inverse = {fused: [] for fused, _ in self.STACKED.values()}
        for frag, (fused, _) in self.STACKED.items():
            inverse[fused].append(frag)
        for i, layer in enumerate(self.model.layers):
            if self.cfg.is_moe_layer(i):
                names |= expected_expert_tensors(self.cfg, f"model.layers.{i}")
        for pname, _ in self.named_parameters():
            if pname.endswith((".experts.gate_up_proj", ".experts.down_proj", "_scale_inv")):
                continue  # listed per expert above, as checkpoints name them; FP8 scales: the loader
            for fused, frags in inverse.items():
                if fused in pname:
                    names.update(pname.replace(fused, f) for f in frags)
                    break
            else:
                names.add(pname)
        return names
