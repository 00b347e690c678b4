"""tests/models: helpers live in _hf.py (importable as ``_hf`` from these tests)."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))


@pytest.fixture
def one_torch_thread():
    """torch on one thread for the test, then back: pdkv's GEMM-type CPU kernels take a step only
    on one thread (models/cpu_kernels.py one_thread)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def fp8_models(tmp_path_factory, tiny_model_dir):
    """FP8 checkpoints (tests/models/_fp8.py) of a tiny DeepSeek-V3 and Qwen3-MoE, built once:
    family → (transformers on the dequantized weights, transformers on the originals, FP8 folder)."""
    import transformers

    from _fp8 import FAMILIES, make_fp8_pair
    from _hf import save_hf_model

    out = {}
    for family, (cfg, cls, kw) in FAMILIES.items():
        root = tmp_path_factory.mktemp(f"fp8_{family}")
        original = save_hf_model(cfg, cls, kw, root / "src", tiny_model_dir)
        make_fp8_pair(root / "src", root / "fp8", root / "deq")
        ref = transformers.AutoModelForCausalLM.from_pretrained(root / "deq", dtype=torch.float32).eval()
        out[family] = (ref, original, root / "fp8")
    return out
