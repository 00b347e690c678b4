"""Bad input gets a clear error naming what was wrong, and changes nothing."""

from __future__ import annotations

import json
import shutil
import sys

import pytest

from pdkv.engine import SamplingParams
from pdkv.errors import BackendUnavailable, InvalidRequest, ModelLoadError, UnsupportedArchitecture


@pytest.mark.parametrize("prompt,params,needle", [
    ([], SamplingParams(), "prompt is empty"),
    ("", SamplingParams(), "prompt is empty"),
    ([1] * 2040, SamplingParams(max_tokens=16), "2056"),
    ([1] * 4000, SamplingParams(max_tokens=1), "4000"),
    ([1, 2], SamplingParams(max_tokens=0), "max_tokens"),
    ([1, 2], SamplingParams(temperature=-0.5), "temperature"),
    ([1, 2], SamplingParams(top_p=0.0), "top_p"),
    ([1, 2], SamplingParams(top_p=1.5), "top_p"),
    ([1, 2], SamplingParams(top_k=-3), "top_k"),
    ([1, 99999], SamplingParams(), "99999"),
    ([1, 2], SamplingParams(stop=[3]), "stop"),
    (None, SamplingParams(), "prompt must be"),
    ([1, "a"], SamplingParams(), "'a'"),
])
def test_bad_request_is_refused_and_changes_nothing(base_engine, prompt, params, needle):
    before = base_engine.stats()
    with pytest.raises(InvalidRequest, match=needle):
        base_engine.add_request("bad", prompt, params)
    assert base_engine.stats() == before
    assert not base_engine.has_unfinished()


def test_validate_request_is_pure_and_a_value_error(base_engine):
    with pytest.raises(ValueError, match="max_tokens"):
        base_engine.validate_request([1, 2, 3], SamplingParams(max_tokens=-1))
    base_engine.validate_request([1, 2, 3], SamplingParams())
    assert not base_engine.has_unfinished()


def test_duplicate_request_id(base_engine):
    base_engine.add_request("dup", [1, 2, 3], SamplingParams(max_tokens=2))
    with pytest.raises(InvalidRequest, match="dup"):
        base_engine.add_request("dup", [4, 5], SamplingParams(max_tokens=2))
    base_engine.abort("dup")
    base_engine.abort("dup")  # second abort and unknown ids are no-ops
    base_engine.abort("never-seen")
    outs = base_engine.step()
    assert [(o.request_id, o.finish_reason) for o in outs] == [("dup", "abort")]
    assert base_engine.allocator.num_free == base_engine.allocator.num_total


def _copy(src, dst):
    shutil.copytree(src, dst)
    return dst


@pytest.mark.parametrize("breakage,needle", [
    (lambda d: (d / "config.json").unlink(), "config.json: file is missing"),
    (lambda d: (d / "config.json").write_text("{not json"), "config.json: malformed JSON"),
    (lambda d: (d / "model.safetensors").unlink(), "no \\*.safetensors"),
    (lambda d: (d / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{}"), "model.safetensors"),
    (lambda d: (d / "tokenizer.json").unlink(), "tokenizer.json: file is missing"),
    (lambda d: (d / "tokenizer.json").write_text("[1, 2"), "tokenizer.json"),
])
def test_broken_model_folder_names_the_file(make_engine, tiny_model_dir, tmp_path, breakage, needle):
    folder = _copy(tiny_model_dir, tmp_path / "m")
    breakage(folder)
    with pytest.raises(ModelLoadError, match=needle):
        make_engine(path=folder)


def test_missing_shard_and_missing_tensor(make_engine, tmp_path):
    from pdkv.tiny_model import make_tiny_model

    folder = make_tiny_model(tmp_path / "sharded", shards=3)
    (folder / "model-00002-of-00003.safetensors").unlink()
    with pytest.raises(ModelLoadError, match="model-00002-of-00003.safetensors"):
        make_engine(path=folder)
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    (folder / "model.safetensors.index.json").unlink()  # now the two remaining shards are globbed
    with pytest.raises(ModelLoadError, match="lacks"):
        make_engine(path=folder)
    assert index["weight_map"]


def test_unknown_architecture_lists_supported(make_engine, tiny_model_dir, tmp_path):
    folder = _copy(tiny_model_dir, tmp_path / "m")
    cfg = json.loads((folder / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedArchitecture, match="GPT2LMHeadModel.*LlamaForCausalLM.*Qwen3ForCausalLM"):
        make_engine(path=folder)


def test_flashinfer_backend_gives_a_clear_error_here(make_engine):
    with pytest.raises(BackendUnavailable, match="flashinfer.*(CUDA|cannot be imported)"):
        make_engine(attention_backend="flashinfer")
    from pdkv.models.attention.flashinfer_backend import _import_flashinfer

    try:
        import flashinfer  # noqa: F401
    except ImportError:
        with pytest.raises(BackendUnavailable, match="flashinfer package cannot be imported"):
            _import_flashinfer()
    with pytest.raises(ValueError, match="unknown backend 'fa9'.*flashinfer.*torch"):
        make_engine(attention_backend="fa9")


def test_torch_backend_never_imports_flashinfer(base_engine):
    base_engine.generate([[1, 2, 3]], SamplingParams(max_tokens=2))
    assert "flashinfer" not in sys.modules
