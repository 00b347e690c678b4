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
