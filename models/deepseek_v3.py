"""DeepSeek-V3 / R1 (``DeepseekV3ForCausalLM``): multi-head latent attention over a latent KV
cache (models/mla.py), a dense MLP in the first ``first_k_dense_replace`` layers and, after them,
a MoE block with sigmoid grouped top-k routing, ``e_score_correction_bias`` and shared experts
(models/moe.py). Rope is on the qk_rope_head_dim part only, with DeepSeek's YaRN scaling
(models/rope.py) and its softmax-scale correction (models/kv_layout.py: mla_softmax_scale).

The multi-token-prediction layer DeepSeek checkpoints carry (``model.layers.{num_hidden_layers}``,
``num_nextn_predict_layers``) is skipped at load: generation does not use it.
"""

from __future__ import annotations

import re

from pdkv.models.mla import MLAttention
from pdkv.models.registry import register_model
from pdkv.models.transformer import CausalLM

_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


@register_model("DeepseekV3ForCausalLM")
class DeepseekV3ForCausalLM(CausalLM):
    attention_cls = MLAttention
    # MLA keeps transformers' names (q_proj is a plain projection here, not part of a qkv fusion).
    STACKED = {".gate_proj.": (".gate_up_proj.", "gate"), ".up_proj.": (".gate_up_proj.", "up")}

    def is_ignorable(self, name: str) -> bool:
        m = _LAYER.match(name)
        return super().is_ignorable(name) or (m is not None and int(m.group(1)) >= self.cfg.num_layers)

    def post_load(self) -> None:
        for layer in self.model.layers:
            layer.self_attn.post_load()
