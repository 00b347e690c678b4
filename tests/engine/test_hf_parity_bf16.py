"""bfloat16 end to end against Hugging Face transformers in bfloat16 (not pdkv's own float32):
two families, the same checkpoint loaded by both in bfloat16, greedy decoding of a batch of
prompts. The first 8 greedy tokens must be equal and every one of those steps' logits close
within a bf16 tolerance -- bf16 keeps 8 significand bits (relative step 2**-8 = 0.4%), so two
correct implementations that order their sums differently drift by ~1% over a few layers; a
real mistake (a wrong cast, a missing norm, a KV cache stored in the wrong precision) is far
beyond that."""

from __future__ import annotations

import shutil

import pytest
import torch

from pdkv.config import KVCacheConfig, ModelConfig, SchedulerConfig
from pdkv.engine import LLMEngine, SamplingParams

NEW_TOKENS = 8
PROMPT_LENS = (6, 23, 41)
REL_TOL = 3e-2  # relative L2 error of a step's logits; measured 0.6-1.5% here
# One thread on both sides: a bf16 sum's rounding depends on how it is split, and a near tie
# (top-2 margins here go down to 0.016 against per-logit differences up to ~0.045) could then
# flip with the thread count the engine's tuner happens to pick.
THREADS = 1
BASE = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            intermediate_size=128, vocab_size=512, max_position_embeddings=256)
CASES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 32}),  # q/k norms, wider heads
}


def _hf_bf16(case, folder, tokenizer_dir):
    import transformers

    cfg_name, model_name, extra = CASES[case]
    cfg = getattr(transformers, cfg_name)(**BASE, **extra)
    torch.manual_seed(0)
    model = getattr(transformers, model_name)(cfg).eval()
    with torch.no_grad():  # random, non-trivial values for every tensor: norms too
        for name, p in model.named_parameters():
            p.copy_(1 + 0.1 * torch.randn_like(p) if "norm" in name else 0.1 * torch.randn_like(p))
    model = model.to(torch.bfloat16)
    model.save_pretrained(folder)  # a bfloat16 checkpoint: both sides read the same bits
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_dir / f, folder / f)
    return model


def _hf_greedy(model, prompt):
    """Greedy decode with transformers' KV cache; returns (tokens, float32 logits [steps, V])."""
    ids = torch.tensor([prompt])
    past, tokens, logits = None, [], []
    with torch.no_grad():
        for _ in range(NEW_TOKENS):
            out = model(input_ids=ids, cache=past, use_cache=True)
            past = getattr(out, "cache", None) or out.past_key_values
            logits.append(out.logits[0, -1].float())
            tokens.append(int(logits[-1].argmax()))
            ids = torch.tensor([[tokens[-1]]])
    return tokens, torch.stack(logits)


@pytest.fixture
def one_thread():
    saved = torch.get_num_threads()
    torch.set_num_threads(THREADS)
    yield
    torch.set_num_threads(saved)


@pytest.mark.parametrize("case", list(CASES))
def test_bf16_greedy_matches_transformers_bf16(case, tmp_path, tiny_model_dir, one_thread):
    model = _hf_bf16(case, tmp_path, tiny_model_dir)
    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, 512, (n,), generator=gen).tolist() for n in PROMPT_LENS]
    engine = LLMEngine(ModelConfig(path=str(tmp_path), dtype="bfloat16"),
                       KVCacheConfig(page_size=16, num_pages=64), SchedulerConfig(), num_threads=THREADS)
    assert engine.loaded.dtype == torch.bfloat16 and engine.kv.layer(0).dtype == torch.bfloat16
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True))
    steps: dict[str, list[torch.Tensor]] = {str(i): [] for i in range(len(prompts))}
    done = {}
    while engine.has_unfinished():
        for out in engine.step():
            row = engine.runner.last_sampled_ids.index(out.request_id)
            steps[out.request_id].append(engine.runner.last_logits[row].float().clone())
            if out.finished:
                done[out.request_id] = out
    for i, p in enumerate(prompts):
        ref_tokens, ref_logits = _hf_greedy(model, p)
        top2 = ref_logits.topk(2, dim=1).values
        assert done[str(i)].output_token_ids == ref_tokens, (
            f"{case}: prompt {i} diverged; transformers' top-2 margins per step "
            f"{[round(m, 3) for m in (top2[:, 0] - top2[:, 1]).tolist()]}")
        ours = torch.stack(steps[str(i)])
        rel = (ours - ref_logits).norm(dim=1) / ref_logits.norm(dim=1)
        assert (rel < REL_TOL).all(), f"{case}: prompt {i} logits rel err per step {rel.tolist()}"
    assert engine.allocator.num_free == engine.allocator.num_total
