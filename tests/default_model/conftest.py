"""tests/default_model: the shipped trained model (pdkv/data/default_model), checked against
``transformers``. Helpers live in _common.py; the disaggregated pair comes from tests/disagg."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "disagg"))  # _cluster: an in-process prefill + decode pair
sys.path.insert(0, str(HERE.parents[1] / "tools"))  # default_model_eval: the 16-prompt evaluation


@pytest.fixture(autouse=True, scope="module")
def one_torch_thread():
    """transformers runs in this process: on a shared 2-core machine two threads spin against
    each other (20x slower here), so these small forwards run on one, as the engines here do."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def shipped_dir() -> Path:
    from pdkv.default_model import ensure_default_model

    return Path(ensure_default_model())


@pytest.fixture(scope="session")
def hf_model(shipped_dir):
    """The shipped folder loaded by transformers, unchanged, in float32 (as pdkv serves it)."""
    import torch
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM.from_pretrained(shipped_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def hf_tokenizer(shipped_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(shipped_dir)
