"""Session fixtures shared by every test directory."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
from hypothesis import Phase, settings

ROOT = Path(__file__).resolve().parents[1]

# `make mutants` (tools/mutants.py) runs property tests with --hypothesis-profile=mutants: a
# fresh search each time (no example database), failing at the first counterexample without
# shrinking it (a mutant needs to be caught, not explained; shrinking takes minutes).
settings.register_profile("mutants", phases=(Phase.explicit, Phase.generate), database=None)


# Each test item gets this many seconds past pytest-timeout's own limit before the watchdog
# (tests/_watchdog.py) prints every stack, kills the worker's child processes and ends the worker.
WATCHDOG_MARGIN_S = float(os.environ.get("PDKV_TEST_WATCHDOG_MARGIN_S", "120"))
_watchdog = None


def pytest_configure(config):
    global _watchdog
    limit = float(config.getini("timeout") or 0)
    if config.getoption("timeout", None) is not None:
        limit = float(config.getoption("timeout"))
    if limit <= 0:  # --timeout=0: someone is debugging and wants no limit at all
        return
    sys.path.insert(0, str(Path(__file__).parent))
    from _watchdog import Watchdog

    # The watchdog writes to this process's real stderr, not to the file pytest captures a test's
    # output into (which nobody reads once the process has ended).
    capman = config.pluginmanager.getplugin("capturemanager")
    if capman is not None:
        capman.suspend_global_capture(in_=False)
    try:
        err = os.fdopen(os.dup(2), "w", buffering=1)
    finally:
        if capman is not None:
            capman.resume_global_capture()
    _watchdog = Watchdog(limit + WATCHDOG_MARGIN_S, err)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    if _watchdog is not None:
        _watchdog.arm(item.nodeid)
    try:
        yield
    finally:
        if _watchdog is not None:
            _watchdog.disarm()


def pytest_unconfigure(config):
    # A process that hangs on its way out (a thread an extension joins at exit) is ended too.
    if _watchdog is not None:
        _watchdog.arm("the end of the session", WATCHDOG_MARGIN_S)


def pytest_collection_modifyitems(config, items):
    """Under pytest-xdist (`make test`: ``--dist loadfile --no-loadscope-reorder``) hand out the
    files that hold a ``slow`` test first, then the rest with the most tests first (xdist's own
    order): each file runs whole on one worker, so a minute-long one-test file handed out last
    would leave the other worker idle for that minute at the end of the run."""
    if not hasattr(config, "workerinput"):  # one process: the order changes nothing
        return
    files: dict[str, list] = {}
    for item in items:
        files.setdefault(item.nodeid.split("::", 1)[0], []).append(item)
    order = sorted(files.values(),
                   key=lambda its: (not any(i.get_closest_marker("slow") for i in its), -len(its)))
    items[:] = [i for its in order for i in its]


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """A tiny llama folder (float32, hidden 64, 2 layers, 4 heads / 2 KV heads, vocab 512),
    built once per session with pdkv.tiny_model."""
    from pdkv.tiny_model import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tiny_llama"), arch="llama", seed=0)


# Code whose lines are indented: a byte-level BPE trained on it merges a newline with the
# indentation after it, the boundary token healing is for.
BOUNDARY_CORPUS = """def add(a, b):
    return a + b


def scale(values, factor):
    result = []
    for value in values:
        result.append(value * factor)
    return result


class Counter:
    def __init__(self):
        self.count = 0

    def increment(self):
        self.count += 1
        return self.count
"""


@pytest.fixture(scope="session")
def boundary_model_dir(tmp_path_factory):
    """The tiny llama (random weights, vocab 512) with a byte-level BPE of 400 tokens trained on
    indented code: "\\n    return" is ``ĊĠĠĠ`` + ``Ġreturn``, so a prompt ending in a newline
    ends on a bare ``Ċ`` that a longer token extends."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from pdkv.tiny_model import SPECIAL_TOKENS, make_tiny_model

    out = make_tiny_model(tmp_path_factory.mktemp("boundary_llama"), arch="llama", seed=1)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=SPECIAL_TOKENS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([BOUNDARY_CORPUS] * 8, trainer)
    assert tok.token_to_id("ĊĠĠĠ") is not None and tok.token_to_id("<|im_end|>") == 2
    tok.save(str(out / "tokenizer.json"))
    return out


# .ci/run sets PDKV_REQUIRE_VERBS=1: there the verbs tests must run, so whatever would skip them
# (pdkv built without verbs, no compiler, no headers) fails the session instead.
REQUIRE_VERBS = os.environ.get("PDKV_REQUIRE_VERBS") == "1"


def verbs_unavailable(reason: str):
    """Skip a verbs test for ``reason`` -- or fail it where PDKV_REQUIRE_VERBS=1."""
    if REQUIRE_VERBS:
        pytest.fail(f"PDKV_REQUIRE_VERBS=1 but {reason}", pytrace=False)
    pytest.skip(reason)


def _load_loopback_build():
    """tests/verbs_loopback/build.py, loaded by path (a module named ``build`` elsewhere on
    sys.path, e.g. PyPA's, must not shadow it)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("pdkv_tests_loopback_build",
                                                  ROOT / "tests" / "verbs_loopback" / "build.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="session")
def loopback_verbs_dir():
    """The directory holding the loopback verbs device (tests/verbs_loopback), for the
    LD_LIBRARY_PATH of child processes only; built once, cached by source hash under the repo's
    git-ignored .cache. Skips (fails under PDKV_REQUIRE_VERBS=1) only where pdkv was built
    without verbs or there is no compiler / no libibverbs headers; a build that fails for any
    other reason (a compile error, an import clash) is an error, never a skip."""
    from pdkv._messenger import HAVE_VERBS

    if not HAVE_VERBS:
        verbs_unavailable("pdkv was built without libibverbs (install libibverbs-dev, then `make install`)")
    build = _load_loopback_build()
    try:
        return build.build_loopback_verbs(ROOT / ".cache" / "verbs_loopback")
    except build.LoopbackUnavailable as e:  # no gcc / no headers: nothing else is skipped
        verbs_unavailable(f"loopback verbs device unavailable: {e}")


@pytest.fixture(scope="session", autouse=True)
def required_verbs(request):
    """Under PDKV_REQUIRE_VERBS=1 every session checks, before its first test, that the extension
    has verbs and the loopback device builds; otherwise each test fails with the reason."""
    if REQUIRE_VERBS:
        request.getfixturevalue("loopback_verbs_dir")
