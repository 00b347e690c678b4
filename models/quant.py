"""``config.json: quantization_config`` of a block-quantized FP8 checkpoint, and the checks of its
tensors against it, from the safetensors headers alone (before any weight is read or moved).

The format is DeepSeek-V3/R1's, which Qwen3's FP8 releases share, vLLM's and SGLang's ``fp8``
method with ``weight_block_size``: a quantized Linear's ``weight`` [N, K] is float8_e4m3fn and
its ``weight_scale_inv`` [ceil(N / bn), ceil(K / bk)] float32 holds one scale per bn x bk block
(the dequantized weight is ``w * scale``; "inv" because it is the inverse of the quantization's
scale). A last block may be partial (R1's kv_a_proj_with_mqa has 576 = 4.5 x 128 rows).
Activations are quantized at run time ("dynamic"): only the weights are in the file.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from pdkv.errors import ModelLoadError

SUPPORTED_METHODS = ("fp8",)
SCALE_SUFFIX = "_scale_inv"  # weight -> weight_scale_inv; experts' gate_up_proj -> gate_up_proj_scale_inv


@dataclass(frozen=True)
class QuantConfig:
    method: str  # "fp8"
    block: tuple[int, int]  # (bn, bk): rows x columns of a weight one scale covers
    activation_scheme: str = "dynamic"
    fmt: str = "e4m3"

    def scale_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        """A weight [..., N, K] → its scale [..., ceil(N / bn), ceil(K / bk)]."""
        bn, bk = self.block
        return (*shape[:-2], math.ceil(shape[-2] / bn), math.ceil(shape[-1] / bk))


def fp8_dtype(source: str) -> torch.dtype:
    """torch.float8_e4m3fn, or a clear error on a torch built without it."""
    dt = getattr(torch, "float8_e4m3fn", None)
    if dt is None:
        raise ModelLoadError(f"{source}: quantization_config.quant_method 'fp8' needs torch.float8_e4m3fn, "
                             f"which torch {torch.__version__} lacks (torch >= 2.1)")
    return dt


def parse_quant_config(hf_config: dict, source: str) -> QuantConfig | None:
    """None for an unquantized checkpoint; every unsupported field is refused by name."""
    q = hf_config.get("quantization_config")
    if q is None:
        return None
    if not isinstance(q, dict):
        raise ModelLoadError(f"{source}: quantization_config must be an object, got {type(q).__name__}")
    method = q.get("quant_method")
    if method not in SUPPORTED_METHODS:
        raise ModelLoadError(f"{source}: quantization_config.quant_method {method!r} is not supported "
                             f"(supported: {', '.join(SUPPORTED_METHODS)})")
    fmt = q.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise ModelLoadError(f"{source}: quantization_config.fmt must be 'e4m3', got {fmt!r}")
    scheme = q.get("activation_scheme", "dynamic")
    if scheme != "dynamic":
        raise ModelLoadError(f"{source}: quantization_config.activation_scheme must be 'dynamic' "
                             f"(activations quantized per 1 x 128 group at run time), got {scheme!r}")
    block = q.get("weight_block_size")
    if (not isinstance(block, list) or len(block) != 2
            or any(isinstance(b, bool) or not isinstance(b, int) or b < 1 for b in block)):
        raise ModelLoadError(f"{source}: quantization_config.weight_block_size must be two positive "
                             f"integers like [128, 128] (per-tensor FP8 is not supported), got {block!r}")
    fp8_dtype(source)
    return QuantConfig(method, (block[0], block[1]), scheme, fmt)


def check_range(qc: QuantConfig, what: str, start: int, stop: int, total: int, dim: int, why: str) -> None:
    """A range [start, stop) of dimension ``dim`` (0: rows, 1: columns) of a quantized tensor of
    ``total`` along it (one fused part, a tensor-parallel slice) must not cut a block: it starts
    on a block boundary and ends on one, or at the end (the allowed partial last block)."""
    b = qc.block[dim]
    if start % b or (stop % b and stop != total):
        name = "rows" if dim == 0 else "columns"
        raise ModelLoadError(f"{what}: {why} takes {name} [{start}, {stop}) of {total}, which cuts a "
                             f"{b}-wide FP8 block (weight_block_size {list(qc.block)}); every part must "
                             "start and end on a block boundary")
