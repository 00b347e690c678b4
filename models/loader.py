"""Loads a Hugging Face model folder from disk: config.json + safetensors (one file, or shards
listed in model.safetensors.index.json). Nothing is fetched from a network.

Every error names the file and what is wrong with it: a missing or malformed config.json, an
unknown architecture (listing the supported ones), a missing shard, a truncated safetensors file,
a tensor of the wrong shape, a tensor the checkpoint lacks.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from pdkv.models.config import ArchConfig, parse_arch_config
from pdkv.models import fp8_load
from pdkv.models.cpu_kernels import AVAILABLE as CPU_KERNELS_AVAILABLE
from pdkv.models.quant import SCALE_SUFFIX, parse_quant_config
from pdkv.models.registry import MODEL_REGISTRY, supported_architectures
from pdkv.errors import ModelLoadError, UnsupportedArchitecture

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_KV_SCALE = re.compile(r"^model\.layers\.(\d+)\.self_attn\.(k|v|kv)_scale$")


@dataclass
class LoadedModel:
    model: torch.nn.Module  # a models.transformer.CausalLM
    arch: ArchConfig
    hf_config: dict  # config.json as read
    dtype: torch.dtype
    path: Path
    # With tensor parallelism ``arch`` is this rank's share (heads, intermediate size: what its
    # modules, KV cache and attention backend are built from) and ``full_arch`` the checkpoint's.
    full_arch: ArchConfig | None = None
    # Per-tensor FP8 KV-cache scales the checkpoint carries (``model.layers.L.self_attn.k_scale``
    # / ``v_scale``, or one ``kv_scale``): layer → (k, v). Read for kv_cache.dtype fp8_e4m3.
    kv_scales: dict | None = None


def read_json(path: Path) -> dict:
    if not path.is_file():
        raise ModelLoadError(f"{path}: file is missing")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ModelLoadError(f"{path}: malformed JSON ({e})") from e
    if not isinstance(data, dict):
        raise ModelLoadError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def resolve_dtype(name: str, hf_config: dict) -> torch.dtype:
    if name == "auto":
        name = hf_config.get("torch_dtype") or hf_config.get("dtype") or "float32"
    if name not in DTYPES:
        raise ModelLoadError(f"model.dtype must be one of {', '.join(DTYPES)} or auto, got {name!r}")
    return DTYPES[name]


def weight_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.exists():
        weight_map = read_json(index).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ModelLoadError(f"{index}: missing or empty 'weight_map'")
        files = [folder / f for f in sorted(set(weight_map.values()))]
        for f in files:
            if not f.is_file():
                raise ModelLoadError(f"{f}: shard listed in {index.name} is missing")
        return files
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{folder}: no *.safetensors weights (model.safetensors or an index) found")
    return files


def transpose_linear_weights(model: torch.nn.Module) -> None:
    """Stores every Linear weight as [in, out] in memory while keeping its [out, in] shape (a
    transposed view). On the CPU without pdkv's small-batch kernel (models/cpu_kernels.py), F.linear
    then runs x @ W_t over contiguous rows: for a decode step (one row of x) MKL's GEMV reads
    that layout faster than [out, in] (11-20 GB/s against 9 GB/s measured; the kernel reads
    [out, in] at 20-25 GB/s: python -m pdkv.bench kernels)."""
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, torch.nn.Linear) and m.weight.dtype in DTYPES.values():  # not FP8
                m.weight.data = m.weight.data.t().contiguous().t()
            for name in getattr(m, "TRANSPOSED_PARAMS", ()):  # stacked weights [n, out, in] (MoE experts)
                p = getattr(m, name)
                if p.dtype not in DTYPES.values():
                    continue  # FP8 experts: models/fp8.py reads them [out, in]
                p.data = p.data.transpose(-1, -2).contiguous().transpose(-1, -2)


def disable_cpu_kernels(model: torch.nn.Module) -> None:
    """model.cpu_kernels: false: the modules that would call pdkv's kernels whatever the weights'
    layout (norms, the one-token MoE step, a tied LM head) use torch's ops instead."""
    for m in model.modules():  # the model itself included
        if hasattr(m, "cpu_kernel"):
            m.cpu_kernel = False


def load_model(path: str | Path, dtype: str = "float32", device: str = "cpu",
               max_positions: int | None = None,
               progress: Callable[[int, int], None] | None = None, tp=None,
               cpu_kernels: bool = True, ep=None) -> LoadedModel:
    """Builds the model for ``path``'s config.json and loads its weights onto ``device``.

    ``tp`` (a models.parallel.TensorParallel): load only this rank's slice of every tensor and
    all-reduce the row-parallel outputs in the forward pass. ``ep`` (a pdkv.dp.ExpertGroup: data
    parallelism with expert parallelism): load every tensor whole but only this rank's routed
    experts, and route the MoE blocks' tokens through its dispatcher; both (tp x dp): this TP rank's
    slice of its DP rank's experts, its lane's dispatcher (pdkv/dp/lane.py). ``cpu_kernels`` (``model.cpu_kernels``):
    on the CPU, run decode-sized GEMMs through pdkv's kernel (models/cpu_kernels.py) where this CPU
    has it; False: torch's GEMMs only (and torch's attention: the engine tells the backend)."""
    from safetensors import safe_open  # noqa: PLC0415

    folder = Path(path)
    if not folder.is_dir():
        raise ModelLoadError(f"{folder}: model folder does not exist")
    config_path = folder / "config.json"
    hf_config = read_json(config_path)
    arch = parse_arch_config(hf_config, str(config_path))
    if arch.architecture not in MODEL_REGISTRY:
        raise UnsupportedArchitecture(
            f"{config_path}: architecture {arch.architecture!r} is not supported "
            f"(supported: {', '.join(supported_architectures())})")
    torch_dtype = resolve_dtype(dtype, hf_config)
    files = weight_files(folder)
    full_arch, layout = arch, None
    if tp is not None and tp.size > 1:
        from pdkv.models.parallel import TPLayout  # noqa: PLC0415

        dp = ep.size if ep is not None else 1  # tp x dp: this TP group is one rank of a DP-EP group
        try:
            layout = TPLayout(tp.rank, tp.size, full_arch, getattr(tp, "expert_parallel", False), dp,
                              ep.rank if dp > 1 else 0)
        except ValueError as e:
            raise ModelLoadError(f"{config_path}: {e}") from None
        arch = layout.local_arch()
    elif ep is not None and ep.size > 1:
        from pdkv.models.parallel import DataParallelError, ExpertLayout  # noqa: PLC0415

        try:
            layout = ExpertLayout(ep.rank, ep.size, full_arch)
        except DataParallelError as e:
            raise ModelLoadError(f"{config_path}: {e}") from None
        arch = layout.local_arch()
    quant = parse_quant_config(hf_config, str(config_path))
    with torch.device("meta"):
        model = MODEL_REGISTRY[arch.architecture](arch, torch_dtype)
    handles = []
    for f in files:
        try:
            handles.append((f, safe_open(str(f), framework="pt", device="cpu")))
        except Exception as e:  # safetensors raises its own error types for bad headers
            raise ModelLoadError(f"{f}: cannot read safetensors file ({e})") from e
    # FP8: every check on the headers, while the model is still on the meta device.
    index = fp8_load.header_index(handles)
    quantized = fp8_load.plan_fp8(index, model, quant, layout, str(config_path))
    if quantized:
        fp8_load.convert(model, quantized, quant, str(config_path))
    model = model.to_empty(device=device)
    params = dict(model.named_parameters())
    expected = model.expected_tensors()
    expected |= {n + SCALE_SUFFIX for n, (_, dt, _) in index.items()
                 if dt == fp8_load.FP8_HEADER and not model.is_ignorable(n)}
    loaded: set[str] = set()
    kv_scales: dict[int, dict] = {}
    total, done = len(index), 0
    with torch.no_grad():
        for f, handle in handles:
            for name in handle.keys():
                done += 1
                kv_scale = _KV_SCALE.match(name)
                if kv_scale is not None:  # an FP8 KV scale: not a parameter
                    value = handle.get_tensor(name).float().reshape(-1)
                    if value.numel() != 1 or not bool(value.isfinite().all()) or float(value[0]) <= 0:
                        raise ModelLoadError(f"{f}: tensor {name!r} must be one positive number (a "
                                             f"per-tensor KV scale), got shape {tuple(value.shape)}")
                    kv_scales.setdefault(int(kv_scale.group(1)), {})[kv_scale.group(2)] = float(value[0])
                    continue
                scale_of = name[:-len(SCALE_SUFFIX)] if name.endswith(".weight" + SCALE_SUFFIX) else None
                if model.is_ignorable(scale_of or name):
                    continue
                pname, rows = model.param_for(scale_of or name)
                if scale_of is not None:
                    if pname not in quantized:
                        raise ModelLoadError(f"{f}: tensor {name!r} scales {scale_of!r}, which is not "
                                             "float8_e4m3fn in the checkpoint")
                    pname, rows = pname + SCALE_SUFFIX, fp8_load.block_rows(quant, rows)
                if pname not in params:
                    raise ModelLoadError(f"{f}: unexpected tensor {name!r} for {arch.architecture}")
                try:
                    tensor = handle.get_tensor(name)
                except Exception as e:
                    raise ModelLoadError(f"{f}: cannot read tensor {name!r} ({e})") from e
                if scale_of is not None and layout is not None:
                    bounds = fp8_load.shard_bounds(layout, scale_of, index[scale_of][2])
                    tensor = tensor[fp8_load.scale_slice(quant, bounds)]
                elif layout is not None:
                    try:
                        tensor = layout.shard_tensor(name, tensor)
                    except ValueError as e:
                        raise ModelLoadError(f"{f}: {e}") from None
                target = params[pname] if rows is None else params[pname][rows]
                if tuple(tensor.shape) != tuple(target.shape):
                    raise ModelLoadError(f"{f}: tensor {name!r} has shape {tuple(tensor.shape)}, "
                                         f"config.json implies {tuple(target.shape)}")
                target.copy_(tensor.to(target.dtype))  # = torch_dtype but for float32 routers
                del tensor  # one tensor at a time in memory besides the model
                loaded.add(name)
                if progress is not None:
                    progress(done, total)
    missing = expected - loaded
    if missing:
        raise ModelLoadError(f"{folder}: checkpoint lacks {len(missing)} tensor(s), e.g. "
                             f"{', '.join(sorted(missing)[:3])}")
    if progress is not None:
        progress(total, total)
    if torch.device(device).type == "cpu" and not (cpu_kernels and CPU_KERNELS_AVAILABLE):
        transpose_linear_weights(model)
        disable_cpu_kernels(model)
    fp8_load.bind(model)
    # Weights derived from the loaded ones (MLA's absorbed W_UK / W_UV, its fused input
    # projection), after the layout above so that they can keep it.
    if hasattr(model, "post_load"):
        model.post_load()
    model.init_rope(max_positions or arch.max_position_embeddings, device)
    if layout is not None and tp is not None:
        from pdkv.models.parallel import attach  # noqa: PLC0415

        attach(model, tp)
    if layout is not None and ep is not None and ep.size > 1:
        ep.attach(model)
    model.eval()
    scales = {i: (d.get("k", d.get("kv", 1.0)), d.get("v", d.get("kv", 1.0))) for i, d in kv_scales.items()}
    return LoadedModel(model, arch, hf_config, torch_dtype, folder, full_arch, scales)
