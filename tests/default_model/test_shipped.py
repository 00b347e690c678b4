"""The shipped default model is an ordinary, small Hugging Face Llama folder, its tokenizer is
read the same way by pdkv and transformers, and its weights are the trained ones: they give the
held-out loss its model card records."""
from __future__ import annotations

import json
import math

import torch

from pdkv.default_model import heldout_loss, model_card_numbers, shipped_heldout_windows
from pdkv.tokenizer import Tokenizer

from _common import CODE_PROMPTS


def test_is_an_ordinary_small_llama_folder(shipped_dir):
    from safetensors.torch import load_file

    cfg = json.loads((shipped_dir / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg["model_type"] == "llama"
    weights = shipped_dir / "model.safetensors"
    assert weights.stat().st_size <= 20 * 2**20
    tensors = load_file(str(weights))
    assert {t.dtype for t in tensors.values()} == {torch.bfloat16}
    n = sum(t.numel() for t in tensors.values())
    card = model_card_numbers(shipped_dir)
    assert n == card["parameters"] and 1_000_000 <= n <= 10_000_000
    readme = (shipped_dir / "README.md").read_text()
    assert f"{card['heldout_loss']:.4f}" in readme and "PSF" in readme


def test_heldout_loss_matches_the_model_card(shipped_dir, hf_model):
    card = model_card_numbers(shipped_dir)
    windows = shipped_heldout_windows(shipped_dir)
    assert windows.numel() == card["heldout_tokens"]
    loss = heldout_loss(hf_model, windows)
    assert abs(loss - card["heldout_loss"]) <= 0.01 * card["heldout_loss"], (loss, card["heldout_loss"])
    # and it is a trained model's loss: uniform guessing over the vocabulary is ln(V) ~ 8.3
    assert loss < 0.6 * math.log(hf_model.config.vocab_size), loss


def test_pdkv_and_transformers_tokenize_and_template_alike(shipped_dir, hf_tokenizer):
    tok = Tokenizer(shipped_dir)
    bos = hf_tokenizer.convert_tokens_to_ids("<|endoftext|>")
    for p in CODE_PROMPTS:
        ids = tok.encode(p)
        assert ids == hf_tokenizer(p)["input_ids"] and ids[0] == bos  # a plain prompt opens with BOS
        assert tok.decode(ids) == p
    messages = [{"role": "user", "content": CODE_PROMPTS[1]}]
    text = tok.apply_chat_template(messages)
    assert text == hf_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text.startswith("<|endoftext|><|im_start|>user\n") and text.endswith("<|im_start|>assistant\n")
    assert tok.eos_token_ids == {hf_tokenizer.convert_tokens_to_ids(t) for t in ("<|im_end|>", "<|endoftext|>")}
