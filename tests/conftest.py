"""Session fixtures shared by every test directory."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """A tiny llama folder (float32, hidden 64, 2 layers, 4 heads / 2 KV heads, vocab 512),
    built once per session with pdkv.tiny_model."""
    from pdkv.tiny_model import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tiny_llama"), arch="llama", seed=0)
