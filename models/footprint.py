"""What one tensor-parallel rank of a model holds in memory, from ``config.json`` alone (no
weights read): the weights in the checkpoint's real dtype (FP8 and its block scales for a
block-quantized checkpoint, models/quant.py) and the KV cache per token in the cache's dtype.

For an FP8 checkpoint the official layout is assumed (every Linear weight of the decoder
layers FP8, everything else in the model dtype, the router in float32) and run through the
loader's own checks (models/fp8_load.py), so a split the loader would refuse (a tensor-parallel
slice that cuts a 128-block) is refused here with the same message. MLA's kv_b_proj counts in the
model dtype: the loader dequantizes it once for the absorbed attention.
"""

from __future__ import annotations

import torch

from pdkv.models import fp8_load
from pdkv.models.config import ArchConfig
from pdkv.models.parallel import TPLayout
from pdkv.models.quant import SCALE_SUFFIX, QuantConfig
from pdkv.models.registry import MODEL_REGISTRY


def _checkpoint_index(full: torch.nn.Module, qc: QuantConfig) -> dict:
    """The header index (name → (source, dtype, shape)) the official FP8 checkpoint of ``full``
    (built on the meta device) would have."""
    params, modules = dict(full.named_parameters()), dict(full.named_modules())
    index = {}
    for name in sorted(full.expected_tensors()):
        pname, rows = full.param_for(name)
        t = params[pname] if rows is None else params[pname][rows]
        mod_name, attr = pname.rsplit(".", 1)
        quantized = name.startswith("model.layers.") and attr in fp8_load.fp8_params(modules[mod_name])
        index[name] = ("config.json", fp8_load.FP8_HEADER if quantized else "BF16", tuple(t.shape))
        if quantized:
            index[name + SCALE_SUFFIX] = ("config.json", "F32", qc.scale_shape(tuple(t.shape)))
    return index


def rank_weight_bytes(arch: ArchConfig, tp: int, dtype: torch.dtype, qc: QuantConfig | None,
                      source: str, expert_parallel: bool = False, dp: int = 1) -> int:
    """Bytes of rank 0's parameters (every rank holds the same shapes). Raises
    TensorParallelError for a degree the model cannot split, ModelLoadError for a split that
    cuts an FP8 block. ``dp`` > 1: a rank of a data-parallel expert-parallel group (everything
    whole but 1/dp of the routed experts: models/parallel.py ExpertLayout; DataParallelError)."""
    if dp > 1:
        from pdkv.models.parallel import ExpertLayout  # noqa: PLC0415

        layout = ExpertLayout(0, dp, arch)
    else:
        layout = TPLayout(0, tp, arch, expert_parallel) if tp > 1 else None
    local = layout.local_arch() if layout is not None else arch
    cls = MODEL_REGISTRY[arch.architecture]
    with torch.device("meta"):
        model = cls(local, dtype)
        full = cls(arch, dtype) if qc is not None else None
    if qc is not None:
        quantized = fp8_load.plan_fp8(_checkpoint_index(full, qc), model, qc, layout, source)
        fp8_load.convert(model, quantized, qc, source)
    total = 0
    for name, p in model.named_parameters():
        if ".kv_b_proj." in name and name.endswith(SCALE_SUFFIX):
            continue  # dequantized at load: no scale ...
        item = torch.empty((), dtype=dtype).element_size() if ".kv_b_proj." in name else p.element_size()
        total += p.numel() * item  # ... and its weight in the model dtype
    return total


def kv_bytes_per_token(arch: ArchConfig, tp: int, itemsize: int) -> int:
    """One rank's cache bytes per token over all layers: the whole latent on every rank (MLA),
    or this rank's KV heads' K and V."""
    if arch.mla is not None:
        return arch.num_layers * arch.mla.latent_dim * itemsize
    heads = len(TPLayout(0, tp, arch).kv_heads) if tp > 1 else arch.num_kv_heads
    return arch.num_layers * 2 * heads * arch.head_dim * itemsize
