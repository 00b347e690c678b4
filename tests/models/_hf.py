"""Shared by the MoE/MLA model tests: a tiny random transformers model saved as a Hugging Face
folder (with the session's tokenizer), its own greedy decode, and pdkv engines over the folder."""

from __future__ import annotations

import shutil

import torch

from pdkv.config import KVCacheConfig, ModelConfig, SchedulerConfig

NEW_TOKENS = 32
PROMPT_LENS = (5, 17, 40)
VOCAB = 512


def save_hf_model(cfg_name: str, model_name: str, kw: dict, folder, tokenizer_dir, seed: int = 0):
    """Builds transformers' ``model_name`` from ``cfg_name(**kw)`` with random non-trivial values
    in every tensor (norms near 1, router biases too) and saves it under ``folder``."""
    import transformers

    cfg = getattr(transformers, cfg_name)(**kw)
    torch.manual_seed(seed)
    model = getattr(transformers, model_name)(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1 + 0.1 * torch.randn_like(p) if "norm" in name else 0.1 * torch.randn_like(p))
        for name, b in model.named_buffers():
            if "e_score_correction_bias" in name:  # selection-only bias: make it matter
                b.copy_(0.05 * torch.randn_like(b))
    model.save_pretrained(folder)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_dir / f, folder / f)
    return model


def prompts(seed: int = 1, lens=PROMPT_LENS) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in lens]


def hf_greedy(model, prompt, new_tokens: int = NEW_TOKENS):
    """Greedy decode with transformers' own KV cache; returns (tokens, last-step logits [V])."""
    ids = torch.tensor([prompt])
    past, tokens, logits = None, [], None
    with torch.no_grad():
        for _ in range(new_tokens):
            out = model(input_ids=ids, cache=past, use_cache=True)
            past, logits = getattr(out, "cache", None) or out.past_key_values, out.logits[0, -1]
            tokens.append(int(logits.argmax()))
            ids = torch.tensor([[tokens[-1]]])
    return tokens, logits


def engine(folder, page_size=16, num_pages=64, layout="HND", chunk=512, budget=2048, max_seqs=64, **model_kw):
    from pdkv.engine import LLMEngine

    return LLMEngine(ModelConfig(path=str(folder), **model_kw),
                     KVCacheConfig(page_size=page_size, num_pages=num_pages, layout=layout),
                     SchedulerConfig(max_num_batched_tokens=budget, chunk_size=chunk, max_num_seqs=max_seqs))


def run_greedy(eng, prompt_list, new_tokens: int = NEW_TOKENS):
    """All prompts batched in one engine; returns ({i: tokens}, {i: last-step logits})."""
    from pdkv.engine import SamplingParams

    for i, p in enumerate(prompt_list):
        eng.add_request(str(i), p, SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True))
    logits, tokens = {}, {}
    while eng.has_unfinished():
        for out in eng.step():
            row = eng.runner.last_sampled_ids.index(out.request_id)
            logits[out.request_id] = eng.runner.last_logits[row].clone()
            if out.finished:
                tokens[out.request_id] = out.output_token_ids
    assert eng.allocator.num_free == eng.allocator.num_total, "pages leaked"
    return [tokens[str(i)] for i in range(len(prompt_list))], [logits[str(i)] for i in range(len(prompt_list))]


def assert_matches_hf(model, eng, prompt_list, label: str) -> None:
    toks, logits = run_greedy(eng, prompt_list)
    for i, p in enumerate(prompt_list):
        ref_tokens, ref_logits = hf_greedy(model, p)
        assert toks[i] == ref_tokens, f"{label}: prompt {i} diverged"
        rel = (logits[i] - ref_logits).norm() / ref_logits.norm()
        assert rel < 1e-4, f"{label}: prompt {i} last-step logits rel err {rel:.2e}"
