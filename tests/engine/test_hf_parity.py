"""Greedy generation matches Hugging Face transformers token for token (float32, GQA, a batch of
prompts of different lengths, 32 new tokens) and the last step's logits agree to 1e-4."""

from __future__ import annotations

import shutil

import pytest
import torch

from pdkv.config import KVCacheConfig, ModelConfig, SchedulerConfig
from pdkv.engine import LLMEngine, SamplingParams

NEW_TOKENS = 32
PROMPT_LENS = (5, 17, 40)
BASE = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            intermediate_size=128, vocab_size=512, max_position_embeddings=256)

CASES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}, None),
    "mistral_sliding": ("MistralConfig", "MistralForCausalLM", {"sliding_window": 16}, None),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}, None),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 32}, None),
    "llama3_rope_tied_sharded": ("LlamaConfig", "LlamaForCausalLM", {
        "tie_word_embeddings": True, "rope_theta": 500000.0,
        "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 32}}, "60KB"),
}


def _hf_model(case, folder, tokenizer_dir):
    import transformers

    cfg_name, model_name, extra, shard = CASES[case]
    cfg = getattr(transformers, cfg_name)(**BASE, **extra)
    torch.manual_seed(0)
    model = getattr(transformers, model_name)(cfg).eval()
    with torch.no_grad():  # random, non-trivial values for every tensor: biases and norms too
        for name, p in model.named_parameters():
            p.copy_(1 + 0.1 * torch.randn_like(p) if "norm" in name else 0.1 * torch.randn_like(p))
    model.save_pretrained(folder, **({"max_shard_size": shard} if shard else {}))
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_dir / f, folder / f)
    return model


def _hf_greedy(model, prompt):
    """Greedy decode with transformers' own KV cache; returns (tokens, last-step logits [V])."""
    ids = torch.tensor([prompt])
    past, tokens, logits = None, [], None
    with torch.no_grad():
        for _ in range(NEW_TOKENS):
            out = model(input_ids=ids, cache=past, use_cache=True)
            past, logits = getattr(out, "cache", None) or out.past_key_values, out.logits[0, -1]
            tokens.append(int(logits.argmax()))
            ids = torch.tensor([[tokens[-1]]])
    return tokens, logits


@pytest.mark.parametrize("case", list(CASES))
def test_greedy_matches_transformers(case, tmp_path, tiny_model_dir):
    model = _hf_model(case, tmp_path, tiny_model_dir)
    if case.endswith("sharded"):
        assert (tmp_path / "model.safetensors.index.json").exists()
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 512, (n,), generator=gen).tolist() for n in PROMPT_LENS]
    engine = LLMEngine(ModelConfig(path=str(tmp_path)), KVCacheConfig(page_size=16, num_pages=64),
                       SchedulerConfig())
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True))
    last_logits = {}
    done = {}
    while engine.has_unfinished():
        for out in engine.step():
            row = engine.runner.last_sampled_ids.index(out.request_id)
            last_logits[out.request_id] = engine.runner.last_logits[row].clone()
            if out.finished:
                done[out.request_id] = out
    for i, p in enumerate(prompts):
        ref_tokens, ref_logits = _hf_greedy(model, p)
        assert done[str(i)].output_token_ids == ref_tokens, f"{case}: prompt {i} diverged"
        rel = (last_logits[str(i)] - ref_logits).norm() / ref_logits.norm()
        assert rel < 1e-4, f"{case}: prompt {i} last-step logits rel err {rel:.2e}"
    assert engine.allocator.num_free == engine.allocator.num_total
