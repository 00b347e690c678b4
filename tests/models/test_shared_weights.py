"""model.share_weights: a second process on the host maps the first one's weights (one copy).

Two child processes (_weights_child.py): the owner loads privately (its anonymous memory grows by
about the weights' size: the control) and serves them; the other attaches: its anonymous memory
grows by less than 10% of the weight bytes with every weight page touched, its greedy tokens
equal a private engine's, and it keeps serving after the owner is killed with SIGKILL.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).parent
ROOT = HERE.parents[1]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """~23 MB of float32 weights: large enough that 10% is far above allocator noise."""
    from pdkv.tiny_model import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("shared_w"), hidden_size=256, num_layers=4,
                           intermediate_size=1024, vocab_size=4096, seed=3)


def _child(role, path):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    p = subprocess.Popen([sys.executable, str(HERE / "_weights_child.py"), role, str(path)], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, text=True, cwd=str(ROOT), env=env)
    return p


def _line(p):
    line = p.stdout.readline()
    assert line, f"child exited (rc {p.wait(30)})"
    return json.loads(line)


def _private_tokens(path):
    from pdkv.config import load_config
    from pdkv.engine import LLMEngine, SamplingParams

    sys.path.insert(0, str(HERE))
    from _weights_child import PROMPTS

    cfg = load_config(overrides=[f"model.path={path}", "kv_cache.page_size=4", "kv_cache.num_pages=64"])
    outs = LLMEngine.from_config(cfg, num_threads=1).generate(
        PROMPTS, SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True))
    return [o.output_token_ids for o in outs]


@pytest.mark.slow  # two child processes with an engine each: ~25 s idle, ~55 s on a loaded machine
def test_second_process_maps_the_owners_weights_and_outlives_it(model_dir):
    torch.set_num_threads(1)
    want = _private_tokens(model_dir)
    owner = _child("owner", model_dir)
    other = None
    try:
        o = _line(owner)
        w = o["weight_bytes"]
        assert o["anon_kib"] * 1024 > 0.8 * w, o  # the control: a private load costs the weights
        assert _line(owner)["tokens"] == want  # the owner computes from the shared copy too
        other = _child("attach", model_dir)
        a = _line(other)
        assert a["weight_bytes"] == w, a  # attached, not loaded privately
        assert a["anon_kib"] * 1024 < 0.10 * w, (a, w)
        assert _line(other)["tokens"] == want
        owner.send_signal(signal.SIGKILL)
        owner.wait(10)
        other.stdin.write("again\n")
        other.stdin.flush()
        assert _line(other)["tokens"] == want  # the mapping outlived its creator
    finally:
        for p in (owner, other):
            if p is not None and p.poll() is None:
                p.kill()
                p.wait(10)


def test_fingerprint_mismatch_is_refused_naming_both(model_dir):
    from pdkv.engine.factory import _fingerprint
    from pdkv.models.loader import load_model
    from pdkv.shared_weights import SharedWeightsError, WeightShare, attach, fetch

    loaded = load_model(model_dir, "float32", "cpu", 64)
    share = WeightShare(loaded.model, "a" * 32)
    try:
        fd, header = fetch("a" * 32)
        try:
            with pytest.raises(SharedWeightsError, match=f"of model {'a' * 32}, this process loads {'b' * 32}"):
                attach(load_model(model_dir, "float32", "cpu", 64).model, "b" * 32, fd, header)
            header["index"][0]["shape"] = [1]  # a tampered index: its checksum no longer matches
            with pytest.raises(SharedWeightsError, match="checksum"):
                attach(load_model(model_dir, "float32", "cpu", 64).model, "a" * 32, fd, header)
        finally:
            os.close(fd)
    finally:
        share.close()
    assert fetch(_fingerprint(loaded)) is None  # no owner of the real fingerprint here
