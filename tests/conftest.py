"""Session fixtures shared by every test directory."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "tests" / "bench"


def _bench_asked(config) -> bool:
    """tests/bench runs only when asked: --benchmark-only, PDKV_BENCH=1, or a path inside it on
    the command line (``pytest tests/bench/test_step.py``)."""
    if config.getoption("benchmark_only", False) or os.environ.get("PDKV_BENCH") == "1":
        return True
    for arg in config.args:
        path = (Path(config.invocation_params.dir) / arg.split("::")[0]).resolve()
        if path == BENCH or BENCH in path.parents:
            return True
    return False


def pytest_ignore_collect(collection_path, config):
    # NOTE: the micro-benchmarks are slow to collect (they build a 57M-parameter model) and are
    # not tests of behaviour alone, so `make test` / `pytest tests` never collects them.
    if collection_path == BENCH and not _bench_asked(config):
        return True
    return None


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
