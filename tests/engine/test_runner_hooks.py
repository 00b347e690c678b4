"""The per-layer hook, the remote-KV state machine and the tiny model generator."""

from __future__ import annotations

import json

import torch

from pdkv.engine import RequestStatus, SamplingParams
from _connectors import RemoteKV, remote_pages

GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
PROMPT = list(range(3, 40))


def test_layer_hook_fires_after_each_layer_and_can_be_removed(base_engine):
    calls = []
    base_engine.connector.after_layer = calls.append
    try:
        base_engine.generate([[1, 2, 3]], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
    finally:
        base_engine.connector.after_layer = None
    assert calls == [0, 1] * 3  # 3 forward passes (prefill + 2 decodes) x 2 layers
    base_engine.generate([[1, 2, 3]], SamplingParams(max_tokens=2))
    assert len(calls) == 6


def test_remote_kv_pages_then_decode_matches_local(make_engine):
    """A 'prefill' engine computes the prompt's K/V; its pages are copied into the pages a
    'decode' engine reserved; the decode engine then gives the same tokens as a local run."""
    prefill, decode = make_engine(num_pages=32), make_engine(num_pages=32)
    local = prefill.generate([PROMPT], GREEDY)[0].output_token_ids
    prefill.add_request("p", PROMPT, SamplingParams(max_tokens=2, temperature=0, ignore_eos=True))
    prefill.step()  # whole prompt prefilled; request still running, its pages hold the K/V
    src = prefill.requests["p"].pages
    free_before = decode.allocator.num_free
    decode.set_connector(RemoteKV())
    decode.add_request("d", PROMPT, GREEDY)
    dst = remote_pages(decode, "d")
    assert len(dst) == -(-(len(PROMPT) - 1) // 16) and all(decode.allocator.is_pinned(p) for p in dst)
    assert decode.requests["d"].status == RequestStatus.WAITING_FOR_REMOTE_KV
    assert decode.step() == []  # nothing runs while the KV is remote
    for layer in range(decode.kv.num_layers):
        decode.kv.layer(layer)[dst] = prefill.kv.layer(layer)[src[:len(dst)]]
    decode.remote_kv_ready("d")
    outs = []
    while decode.has_unfinished():
        outs += decode.step()
    assert outs[-1].output_token_ids == local
    assert decode.allocator.num_free == free_before
    prefill.abort("p")
    assert prefill.allocator.num_free == prefill.allocator.num_total


def test_remote_reservation_abort_and_full(make_engine):
    """A remote reservation whose pages are not free waits for admission holding nothing, and
    is admitted once an abort gave them back; aborting a waiting one leaves no output."""
    engine = make_engine(num_pages=4)
    engine.set_connector(RemoteKV())
    engine.add_request("a", list(range(1, 40)), GREEDY)  # 38 tokens → 3 pages
    assert len(remote_pages(engine, "a")) == 3 and engine.allocator.num_free == 1
    engine.add_request("b", list(range(1, 40)), GREEDY)  # not yet: 3 pages needed, 1 free
    engine.add_request("c", [1, 2], GREEDY)  # behind b, in order, though its 1 page is free
    assert [engine.requests[r].status for r in "bc"] == [RequestStatus.PENDING] * 2
    assert engine.num_pending == 2 and not engine.requests["b"].pages and engine.allocator.num_free == 1
    engine.abort("a")
    engine.abort("a")
    assert engine.allocator.num_free == 4
    assert engine.admit() == [] and engine.num_pending == 0
    assert len(remote_pages(engine, "b")) == 3 and len(remote_pages(engine, "c")) == 1
    assert [o.finish_reason for o in engine.step()] == ["abort"]
    engine.abort("b")
    engine.abort("c")
    engine.step()
    assert engine.allocator.num_free == 4 and not engine.requests


def test_tiny_model_generator_all_families(tmp_path, make_engine):
    from pdkv.tiny_model import make_tiny_model

    for arch in ("llama", "mistral", "qwen2", "qwen3"):
        folder = make_tiny_model(tmp_path / arch, arch=arch, shards=2 if arch == "qwen3" else 1,
                                 tie_word_embeddings=arch == "qwen2")
        cfg = json.loads((folder / "config.json").read_text())
        assert cfg["architectures"][0].lower().startswith(arch)
        engine = make_engine(path=folder, num_pages=16)
        out = engine.generate(["Hello, world!"], GREEDY)[0]
        assert out.num_output_tokens == 8
    again = make_tiny_model(tmp_path / "again", arch="qwen3", shards=2, tie_word_embeddings=False)
    assert (again / "tokenizer.json").read_text() == (tmp_path / "qwen3" / "tokenizer.json").read_text()


def test_half_precision_dtypes_run(make_engine):
    one = SamplingParams(max_tokens=1, temperature=0)
    ref = make_engine(num_pages=16)
    ref.generate([PROMPT], one)
    l32 = ref.runner.last_logits
    for dtype, tol in (("bfloat16", 0.05), ("float16", 0.01)):
        engine = make_engine(num_pages=16, dtype=dtype)
        assert engine.kv.dtype == getattr(torch, dtype)
        assert engine.loaded.model.lm_head.weight.dtype == getattr(torch, dtype)
        engine.generate([PROMPT], one)
        # The same weights rounded: first-step logits stay close to float32's.
        l16 = engine.runner.last_logits
        assert l16.dtype == torch.float32 and l16.shape == l32.shape
        rel = float((l16 - l32).norm() / l32.norm())
        assert rel < tol, f"{dtype}: rel err {rel:.3g}"


def test_from_config_reports_load_progress(tiny_model_dir):
    from pdkv.config import Config, KVCacheConfig, ModelConfig
    from pdkv.engine import LLMEngine

    seen = []
    cfg = Config(model=ModelConfig(path=str(tiny_model_dir), served_name="tiny"),
                 kv_cache=KVCacheConfig(num_pages=8))
    engine = LLMEngine.from_config(cfg, progress=lambda done, total: seen.append((done, total)))
    assert seen and seen[-1][0] == seen[-1][1] > 0
    assert all(a <= b for (a, _), (b, _) in zip(seen, seen[1:]))
    assert engine.model_name == "tiny" and engine.max_model_len == 2048
    assert engine.config["architectures"] == ["LlamaForCausalLM"]
    assert engine.stats()["num_pages_total"] == 8


def test_cli_writes_a_loadable_folder(tmp_path, make_engine):
    import os
    import subprocess
    import sys

    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]
    out = subprocess.run([sys.executable, "-m", "pdkv.tiny_model", str(tmp_path / "cli"), "--arch", "qwen2",
                          "--num-layers", "1"], capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONPATH": str(repo)})
    assert out.stdout.strip().endswith("cli")
    engine = make_engine(path=tmp_path / "cli", num_pages=8)
    assert engine.loaded.arch.num_layers == 1 and engine.loaded.arch.attention_bias


def test_failed_forward_pass_finishes_with_error_and_frees(base_engine):
    """Fault injection: a layer hook that raises makes the step's requests finish with 'error';
    the engine keeps working and every page comes back."""
    def boom(layer):
        raise RuntimeError("injected fault")

    base_engine.add_request("e1", PROMPT, GREEDY)
    base_engine.add_request("e2", [4, 5, 6], GREEDY)
    base_engine.connector.after_layer = boom
    try:
        outs = base_engine.step()
    finally:
        base_engine.connector.after_layer = None
    assert sorted((o.request_id, o.finish_reason, o.finished) for o in outs) == [
        ("e1", "error", True), ("e2", "error", True)]
    assert not base_engine.has_unfinished()
    assert base_engine.allocator.num_free == base_engine.allocator.num_total
    assert base_engine.generate([PROMPT], GREEDY)[0].finish_reason == "length"
