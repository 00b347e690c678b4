"""Bad FP8 checkpoints are refused naming the field or the tensor, before any weight is read into
the model or moved to a device (the model's ``to_empty`` is made to fail here: an error that came
after it would surface as that failure instead)."""

from __future__ import annotations

import json
import shutil
import types

import pytest
import torch
from safetensors.torch import load_file, save_file

from _fp8 import DEEPSEEK, make_fp8_pair
from _hf import save_hf_model
from pdkv.models.loader import load_model
from pdkv.errors import ModelLoadError

SCALE = "model.layers.0.self_attn.q_a_proj.weight_scale_inv"


@pytest.fixture(scope="module")
def fp8_folder(tmp_path_factory, tiny_model_dir):
    root = tmp_path_factory.mktemp("fp8_bad")
    save_hf_model("DeepseekV3Config", "DeepseekV3ForCausalLM", {**DEEPSEEK, "num_hidden_layers": 1},
                  root / "src", tiny_model_dir)
    make_fp8_pair(root / "src", root / "fp8", root / "deq")
    return root


@pytest.fixture
def no_device_move(monkeypatch):
    from pdkv.models.deepseek_v3 import DeepseekV3ForCausalLM

    def refuse(self, *a, **k):
        raise AssertionError("weights were being moved before the checkpoint was checked")
    monkeypatch.setattr(DeepseekV3ForCausalLM, "to_empty", refuse)


def _copy(fp8_folder, tmp_path, config_change=None, tensors=None):
    d = tmp_path / "m"
    shutil.copytree(fp8_folder / "fp8", d)
    if config_change is not None:
        cfg = json.loads((d / "config.json").read_text())
        config_change(cfg)
        (d / "config.json").write_text(json.dumps(cfg))
    if tensors is not None:
        ts = load_file(str(d / "model.safetensors"))
        tensors(ts)
        save_file(ts, str(d / "model.safetensors"), metadata={"format": "pt"})
    return d


def _set(key, value):
    def change(cfg):
        if value is None:
            cfg["quantization_config"].pop(key)
        else:
            cfg["quantization_config"][key] = value
    return change


BAD_CONFIG = [
    (_set("quant_method", "gptq"), r"quantization_config.quant_method 'gptq' is not supported \(supported: fp8\)"),
    (_set("weight_block_size", None), "quantization_config.weight_block_size must be two positive integers"),
    (_set("weight_block_size", [128]), "weight_block_size must be two positive integers"),
    (_set("fmt", "e5m2"), "quantization_config.fmt must be 'e4m3'"),
    (_set("activation_scheme", "static"), "activation_scheme must be 'dynamic'"),
    (lambda c: c.pop("quantization_config"), "float8_e4m3fn but .*config.json has no quantization_config"),
]


@pytest.mark.parametrize("change,message", BAD_CONFIG, ids=[str(i) for i in range(len(BAD_CONFIG))])
def test_bad_quantization_config_names_the_field(change, message, fp8_folder, tmp_path, no_device_move):
    with pytest.raises(ModelLoadError, match=message):
        load_model(_copy(fp8_folder, tmp_path, config_change=change))


def test_missing_scale_names_the_tensor(fp8_folder, tmp_path, no_device_move):
    d = _copy(fp8_folder, tmp_path, tensors=lambda ts: ts.pop(SCALE))
    with pytest.raises(ModelLoadError, match=f"'model.layers.0.self_attn.q_a_proj.weight' is float8_e4m3fn "
                                             f"but the checkpoint has no '{SCALE}'"):
        load_model(d)


def test_wrong_shaped_scale_names_the_tensor(fp8_folder, tmp_path, no_device_move):
    d = _copy(fp8_folder, tmp_path, tensors=lambda ts: ts.update({SCALE: torch.ones(2, 2)}))
    with pytest.raises(ModelLoadError, match=rf"'{SCALE}' is F32 \(2, 2\); weight \(128, 256\) in \[128, 128\] "
                                             r"blocks needs a float32 scale of shape \(1, 2\)"):
        load_model(d)


def test_fp8_where_pdkv_keeps_the_tensor_unquantized(fp8_folder, tmp_path, no_device_move):
    def quantize_router(ts):
        ts["model.embed_tokens.weight"] = ts["model.embed_tokens.weight"].to(torch.float8_e4m3fn)
        ts["model.embed_tokens.weight_scale_inv"] = torch.ones(4, 2)
    d = _copy(fp8_folder, tmp_path, tensors=quantize_router)
    with pytest.raises(ModelLoadError, match="'model.embed_tokens.weight' is float8_e4m3fn, but pdkv keeps "
                                             "model.embed_tokens.weight unquantized"):
        load_model(d)


def test_block_that_a_fused_part_would_cut(fp8_folder, tmp_path, no_device_move):
    """96-row blocks: the gate rows [0, 256) of gate_up_proj end inside a block that the up rows
    would share (a partial block is allowed only at a tensor's end)."""
    d = tmp_path / "b96"
    make_fp8_pair(fp8_folder / "src", d, tmp_path / "deq96", block=(96, 128))
    with pytest.raises(ModelLoadError, match=r"gate_proj.weight: fusing it into .*gate_up_proj.weight takes "
                                             r"rows \[0, 256\) of 512, which cuts a 96-wide FP8 block"):
        load_model(d)


def test_tensor_parallel_split_that_cuts_a_block(fp8_folder, no_device_move):
    """tp=4: one 64-value head per rank, so o_proj's input columns [0, 64) cut a 128-block.
    (rank and size are all the loader reads of its tp argument before the model is built.)"""
    with pytest.raises(ModelLoadError, match=r"model.layers.0.* tensor parallelism \(parallel.tp=4, rank 0\) "
                                             r"takes (rows|columns) \[0, 64\) of 256, which cuts a 128-wide"):
        load_model(fp8_folder / "fp8", tp=types.SimpleNamespace(rank=0, size=4))


def test_torch_without_float8(fp8_folder, monkeypatch, no_device_move):
    monkeypatch.delattr(torch, "float8_e4m3fn")
    with pytest.raises(ModelLoadError, match="quant_method 'fp8' needs torch.float8_e4m3fn, which torch"):
        load_model(fp8_folder / "fp8")
