"""Writes a small, valid Hugging Face model folder with seeded random weights, for tests, demos
and benchmarks: config.json, model.safetensors (or shards + index), tokenizer.json (byte-level
BPE trained deterministically on a built-in corpus), tokenizer_config.json (chat template, eos)
and generation_config.json. Needs torch, safetensors and tokenizers; not transformers.

CLI: ``python -m pdkv.tiny_model OUT [--arch llama] [--hidden-size 64] ...``
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

ARCHS = {"llama": ("LlamaForCausalLM", "llama"), "mistral": ("MistralForCausalLM", "mistral"),
         "qwen2": ("Qwen2ForCausalLM", "qwen2"), "qwen3": ("Qwen3ForCausalLM", "qwen3")}
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = ("{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
                 "{{ message['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
CORPUS = """The quick brown fox jumps over the lazy dog. A decode node reserves pages for the prompt,
a prefill node computes the key and value cache and writes it, layer by layer, into those pages.
Hello, world! How are you today? I am fine, thank you. What is the capital of France? Paris.
def forward(self, x): return self.proj(x) + x  # residual stream
for i in range(10): print(i * i)
Il gatto dorme sul divano. Perché il cielo è blu? Caffè, città, già, più.
日本語のテキスト。中文文本。한국어 텍스트. Emoji: 😀 🚀 ✨ 👍🏽.
Numbers: 0 1 2 3 4 5 6 7 8 9 10 100 1000 3.14159 2.71828 -42 +7 1e-6.
Serving large language models needs paged attention, continuous batching and chunked prefill.
"""


def train_tokenizer(vocab_size: int):
    """A byte-level BPE over CORPUS; at most ``vocab_size`` tokens (fewer if merges run out)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers  # noqa: PLC0415

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(CORPUS.splitlines() * 4, trainer)
    return tok


def _config(arch: str, hidden_size, num_layers, num_heads, num_kv_heads, head_dim, intermediate_size,
            vocab_size, max_position_embeddings, tie_word_embeddings, dtype, eos_id, rope_scaling):
    architecture, model_type = ARCHS[arch]
    cfg = {
        "architectures": [architecture], "model_type": model_type, "hidden_act": "silu",
        "hidden_size": hidden_size, "intermediate_size": intermediate_size,
        "num_hidden_layers": num_layers, "num_attention_heads": num_heads,
        "num_key_value_heads": num_kv_heads, "head_dim": head_dim,
        "max_position_embeddings": max_position_embeddings, "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0, "vocab_size": vocab_size, "tie_word_embeddings": tie_word_embeddings,
        "bos_token_id": None, "eos_token_id": eos_id, "torch_dtype": dtype,
        "attention_bias": False, "initializer_range": 0.02,
    }
    if rope_scaling:
        cfg["rope_scaling"] = rope_scaling
    if arch == "mistral":
        cfg["sliding_window"] = None
    if arch in ("qwen2", "qwen3"):
        cfg["use_sliding_window"] = False
    return cfg


def _weights(cfg: dict, arch: str, seed: int, std: float) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    H, I, V = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    D, nh, nkv = cfg["head_dim"], cfg["num_attention_heads"], cfg["num_key_value_heads"]

    def rand(*shape, scale=std):
        return torch.randn(*shape, generator=g) * scale

    def norm(n):
        return 1.0 + rand(n, scale=0.1)

    w = {"model.embed_tokens.weight": rand(V, H, scale=1.0), "model.norm.weight": norm(H)}
    if not cfg["tie_word_embeddings"]:
        w["lm_head.weight"] = rand(V, H)
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = norm(H)
        w[p + "post_attention_layernorm.weight"] = norm(H)
        w[p + "self_attn.q_proj.weight"] = rand(nh * D, H)
        w[p + "self_attn.k_proj.weight"] = rand(nkv * D, H)
        w[p + "self_attn.v_proj.weight"] = rand(nkv * D, H)
        w[p + "self_attn.o_proj.weight"] = rand(H, nh * D)
        if arch == "qwen2":
            for n, size in (("q", nh * D), ("k", nkv * D), ("v", nkv * D)):
                w[p + f"self_attn.{n}_proj.bias"] = rand(size)
        if arch == "qwen3":
            w[p + "self_attn.q_norm.weight"] = norm(D)
            w[p + "self_attn.k_norm.weight"] = norm(D)
        w[p + "mlp.gate_proj.weight"] = rand(I, H)
        w[p + "mlp.up_proj.weight"] = rand(I, H)
        w[p + "mlp.down_proj.weight"] = rand(H, I)
    for i in range(cfg.get("num_nextn_predict_layers", 0)):
        # A DeepSeek-V3-style MTP layer after the decoder layers: norms of the token embedding
        # and of the target's hidden state, their projection, one decoder layer, the head's norm.
        p = f"model.layers.{cfg['num_hidden_layers'] + i}."
        w[p + "enorm.weight"], w[p + "hnorm.weight"] = norm(H), norm(H)
        w[p + "eh_proj.weight"] = rand(H, 2 * H)
        w[p + "shared_head.norm.weight"] = norm(H)
        w[p + "input_layernorm.weight"] = norm(H)
        w[p + "post_attention_layernorm.weight"] = norm(H)
        w[p + "self_attn.q_proj.weight"] = rand(nh * D, H)
        w[p + "self_attn.k_proj.weight"] = rand(nkv * D, H)
        w[p + "self_attn.v_proj.weight"] = rand(nkv * D, H)
        w[p + "self_attn.o_proj.weight"] = rand(H, nh * D)
        w[p + "mlp.gate_proj.weight"] = rand(I, H)
        w[p + "mlp.up_proj.weight"] = rand(I, H)
        w[p + "mlp.down_proj.weight"] = rand(H, I)
    return w


def _save(weights: dict, out: Path, dtype: str, shards: int) -> None:
    from safetensors.torch import save_file  # noqa: PLC0415

    tdtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]
    weights = {k: v.to(tdtype).contiguous() for k, v in weights.items()}
    if shards <= 1:
        save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
        return
    names = list(weights)
    weight_map, total = {}, sum(t.numel() * t.element_size() for t in weights.values())
    for s in range(shards):
        fname = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        part = {n: weights[n] for n in names[s::shards]}
        save_file(part, str(out / fname), metadata={"format": "pt"})
        weight_map.update({n: fname for n in part})
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


def make_tiny_model(out_dir, arch: str = "llama", hidden_size: int = 64, num_layers: int = 2,
                    num_heads: int = 4, num_kv_heads: int = 2, intermediate_size: int | None = None,
                    vocab_size: int = 512, max_position_embeddings: int = 2048,
                    tie_word_embeddings: bool = False, seed: int = 0, dtype: str = "float32",
                    shards: int = 1, head_dim: int | None = None, rope_scaling: dict | None = None,
                    std: float = 0.1, num_nextn_predict_layers: int = 0) -> Path:
    """Writes the folder and returns its path. The tokenizer has at most ``vocab_size`` tokens."""
    if arch not in ARCHS:
        raise ValueError(f"arch must be one of {', '.join(ARCHS)}, got {arch!r}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = train_tokenizer(vocab_size)
    eos_id = tok.token_to_id("<|im_end|>")
    cfg = _config(arch, hidden_size, num_layers, num_heads, num_kv_heads,
                  head_dim or hidden_size // num_heads, intermediate_size or 4 * hidden_size,
                  vocab_size, max_position_embeddings, tie_word_embeddings, dtype, eos_id, rope_scaling)
    if num_nextn_predict_layers:
        if arch not in ("llama", "mistral"):
            raise ValueError(f"num_nextn_predict_layers: MTP layers are made for llama / mistral, not {arch}")
        cfg["num_nextn_predict_layers"] = num_nextn_predict_layers
    _save(_weights(cfg, arch, seed, std), out, dtype, shards)
    tok.save(str(out / "tokenizer.json"))
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": None, "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>", "model_max_length": max_position_embeddings,
        "chat_template": CHAT_TEMPLATE}, indent=2))
    (out / "generation_config.json").write_text(json.dumps({
        "eos_token_id": [eos_id, tok.token_to_id("<|endoftext|>")], "do_sample": False}, indent=2))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m pdkv.tiny_model", description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("--arch", default="llama", choices=sorted(ARCHS))
    ap.add_argument("--hidden-size", type=int, default=64)
    ap.add_argument("--num-layers", type=int, default=2)
    ap.add_argument("--num-heads", type=int, default=4)
    ap.add_argument("--num-kv-heads", type=int, default=2)
    ap.add_argument("--intermediate-size", type=int, default=None)
    ap.add_argument("--vocab-size", type=int, default=512)
    ap.add_argument("--max-position-embeddings", type=int, default=2048)
    ap.add_argument("--tie-word-embeddings", action="store_true")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--shards", type=int, default=1)
    a = ap.parse_args(argv)
    path = make_tiny_model(a.out, a.arch, a.hidden_size, a.num_layers, a.num_heads, a.num_kv_heads,
                           a.intermediate_size, a.vocab_size, a.max_position_embeddings,
                           a.tie_word_embeddings, a.seed, a.dtype, a.shards)
    print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
