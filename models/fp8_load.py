"""Loading a block-quantized FP8 checkpoint (models/quant.py) as it is stored: no dequantized copy.

``plan_fp8`` reads only the safetensors headers and decides which parameters hold FP8: those
whose checkpoint tensors are float8_e4m3fn (every Linear the checkpoint quantizes: attention
projections, dense MLPs, routed and shared experts). What the file leaves unquantized (embeddings,
norms, lm_head, the router, e_score_correction_bias) keeps its dtype. Every problem (a missing or
wrongly shaped ``weight_scale_inv``, FP8 where pdkv keeps a tensor unquantized, a fused part or
a tensor-parallel slice that cuts a block) is refused there, while the model is still on the
meta device. ``convert`` then gives those parameters their FP8 shape and a float32 scale
parameter ``<name>_scale_inv`` beside them (a Linear's is ``weight_scale_inv``, the checkpoint's
own name), so the loader copies the file's bytes straight in; ``bind`` hangs each scale on its
weight (``weight.scale_inv``) for the compute (models/fp8.py).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from pdkv.models.quant import SCALE_SUFFIX, QuantConfig, check_range, fp8_dtype
from pdkv.errors import ModelLoadError

FP8_HEADER = "F8_E4M3"
SCALE_DTYPES = ("F32", "BF16", "F16")


def fp8_params(module: nn.Module) -> tuple[str, ...]:
    """The parameters of ``module`` that may hold FP8: a Linear's weight, or what the module
    declares (the fused experts' ``FP8_PARAMS``)."""
    if isinstance(module, nn.Linear):
        return ("weight",)
    return getattr(module, "FP8_PARAMS", ())


def header_index(handles) -> dict[str, tuple]:
    """name → (file, safetensors dtype string, shape) from every file's header (no data read)."""
    out = {}
    for f, h in handles:
        for name in h.keys():
            sl = h.get_slice(name)
            out[name] = (f, sl.get_dtype(), tuple(sl.get_shape()))
    return out


def shard_bounds(layout, name: str, shape: tuple[int, ...]) -> tuple[int, int, int, int]:
    """(row start, row stop, column start, column stop) of this rank's slice of weight ``name``
    [N, K], as models/parallel.py's shard_tensor cuts it (found by cutting a meta tensor)."""
    N, K = shape
    if layout is None:
        return 0, N, 0, K
    view = layout.shard_tensor(name, torch.empty(shape, device="meta"))
    off = view.storage_offset()
    if view.shape[1] == K:
        return off // K, off // K + view.shape[0], 0, K
    return 0, N, off, off + view.shape[1]


def scale_slice(qc: QuantConfig, bounds: tuple[int, int, int, int]) -> tuple[slice, slice]:
    bn, bk = qc.block
    r0, r1, c0, c1 = bounds
    return slice(r0 // bn, math.ceil(r1 / bn)), slice(c0 // bk, math.ceil(c1 / bk))


def block_rows(qc: QuantConfig, rows):
    """A fused parameter's row index (models/transformer.py param_for) → its scale's row index."""
    def conv(s):
        return slice(s.start // qc.block[0], math.ceil(s.stop / qc.block[0])) if isinstance(s, slice) else s
    if rows is None:
        return None
    if isinstance(rows, tuple):
        return tuple(conv(r) for r in rows)
    return conv(rows)


def plan_fp8(index: dict, model: nn.Module, qc: QuantConfig | None, layout, source: str) -> set[str]:
    """The parameter names that hold FP8 (``model`` on the meta device); raises ModelLoadError
    naming the tensor for anything inconsistent."""
    params, modules = dict(model.named_parameters()), dict(model.named_modules())
    quantized: dict[str, list] = {}
    plain: dict[str, str] = {}
    for name, (f, dtype, shape) in index.items():
        if name.endswith((".weight" + SCALE_SUFFIX, "self_attn.k_scale", "self_attn.v_scale", "self_attn.kv_scale")) \
                or model.is_ignorable(name):
            continue
        if dtype.startswith("F8_") and dtype != FP8_HEADER:
            raise ModelLoadError(f"{f}: tensor {name!r} is {dtype}; only float8_e4m3fn (F8_E4M3) FP8 is supported")
        pname, rows = model.param_for(name)
        if dtype != FP8_HEADER:
            plain[pname] = name
            continue
        if qc is None:
            raise ModelLoadError(f"{f}: tensor {name!r} is float8_e4m3fn but {source} has no "
                                 "quantization_config (quant_method fp8, weight_block_size)")
        sname = name + SCALE_SUFFIX
        if sname not in index:
            raise ModelLoadError(f"{f}: tensor {name!r} is float8_e4m3fn but the checkpoint has no {sname!r}")
        sfile, sdtype, sshape = index[sname]
        want = qc.scale_shape(shape)
        if len(shape) != 2 or sshape != want or sdtype not in SCALE_DTYPES:
            raise ModelLoadError(f"{sfile}: tensor {sname!r} is {sdtype} {sshape}; weight {shape} in "
                                 f"{list(qc.block)} blocks needs a float32 scale of shape {want}")
        if pname not in params:
            raise ModelLoadError(f"{f}: unexpected tensor {name!r} for {model.cfg.architecture}")
        mod_name, attr = pname.rsplit(".", 1)
        if attr not in fp8_params(modules[mod_name]):
            raise ModelLoadError(f"{f}: tensor {name!r} is float8_e4m3fn, but pdkv keeps {pname} "
                                 "unquantized (only Linear weights and experts are FP8)")
        bounds = shard_bounds(layout, name, shape)
        if layout is not None:
            why = f"tensor parallelism (parallel.tp={layout.tp}, rank {layout.rank})"
            check_range(qc, name, bounds[0], bounds[1], shape[0], 0, why)
            check_range(qc, name, bounds[2], bounds[3], shape[1], 1, why)
        quantized.setdefault(pname, []).append((name, rows))
    for pname, parts in quantized.items():
        if pname in plain:
            raise ModelLoadError(f"{source}: {plain[pname]!r} is not FP8 while {parts[0][0]!r}, fused "
                                 f"with it into {pname}, is: the fused parts must agree")
        total = params[pname].shape[-2]
        for name, rows in parts:
            r = rows[-1] if isinstance(rows, tuple) else rows
            if isinstance(r, slice):
                check_range(qc, name, r.start, r.stop, total, 0, f"fusing it into {pname}")
    return set(quantized)


def _owner(model: nn.Module, pname: str) -> tuple[nn.Module, str]:
    mod_name, attr = pname.rsplit(".", 1)
    return model.get_submodule(mod_name), attr


def convert(model: nn.Module, pnames: set[str], qc: QuantConfig, source: str) -> None:
    """Gives the parameters ``pnames`` (model on the meta device) their FP8 dtype and registers
    each one's float32 block scale beside it."""
    fp8 = fp8_dtype(source)
    for pname in sorted(pnames):
        mod, attr = _owner(model, pname)
        shape = tuple(getattr(mod, attr).shape)
        setattr(mod, attr, nn.Parameter(torch.empty(shape, dtype=fp8, device="meta"), requires_grad=False))
        mod.register_parameter(attr + SCALE_SUFFIX, nn.Parameter(
            torch.empty(qc.scale_shape(shape), dtype=torch.float32, device="meta"), requires_grad=False))
        mod.fp8_block = qc.block


def bind(model: nn.Module) -> int:
    """Hangs each FP8 weight's scale and block on it (``w.scale_inv``, ``w.fp8_block``), where
    models/cpu_kernels.py linear finds them; returns the number of FP8 parameters."""
    n = 0
    for mod in model.modules():
        for attr in fp8_params(mod):
            w = getattr(mod, attr, None)
            if w is not None and w.dtype == getattr(torch, "float8_e4m3fn", None):
                w.scale_inv, w.fp8_block = getattr(mod, attr + SCALE_SUFFIX), mod.fp8_block
                n += 1
    return n


def expert_views(w: torch.Tensor) -> list[torch.Tensor]:
    """A fused experts' weight [E, N, K] → E views [N, K], each with its own scale bound."""
    views = list(w.detach().unbind(0))
    scale = getattr(w, "scale_inv", None)
    if scale is not None:
        for v, s in zip(views, scale.detach().unbind(0)):
            v.scale_inv, v.fp8_block = s, w.fp8_block
    return views


def weight_bytes(model: nn.Module) -> int:
    """Bytes of every parameter in its real dtype (FP8 weights and their scales included)."""
    return sum(p.numel() * p.element_size() for p in model.parameters())
