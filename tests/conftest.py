"""Session fixtures shared by every test directory."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """A tiny llama folder (float32, hidden 64, 2 layers, 4 heads / 2 KV heads, vocab 512),
    built once per session with pdkv.tiny_model."""
    from pdkv.tiny_model import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tiny_llama"), arch="llama", seed=0)


@pytest.fixture(scope="session")
def loopback_verbs_dir():
    """The directory holding the loopback verbs device (tests/verbs_loopback), for the
    LD_LIBRARY_PATH of child processes only; built once, cached by source hash under the repo's
    git-ignored .cache. Skips with the reason where pdkv has no verbs or the device cannot build."""
    from pdkv._messenger import HAVE_VERBS

    if not HAVE_VERBS:
        pytest.skip("pdkv built without libibverbs")
    sys.path.insert(0, str(ROOT / "tests" / "verbs_loopback"))
    try:
        from build import build_loopback_verbs  # tests/verbs_loopback/build.py

        return build_loopback_verbs(ROOT / ".cache" / "verbs_loopback")
    except Exception as e:  # no gcc / headers
        pytest.skip(f"loopback verbs device unavailable: {e}")
    finally:
        sys.path.pop(0)
