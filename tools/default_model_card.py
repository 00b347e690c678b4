"""The default model's report: its model card (README.md in the folder) and its loss-curve PNG,
both written from the training record by tools/train_default_model.py (and rewritable from a
folder's training.json without training again: ``python tools/default_model_card.py FOLDER``).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def _pre_tokenizer(r: dict) -> str:
    if r.get("pre_tokenizer", "gpt2") == "newline-apart":
        return ("every `\\n` is a pre-token of its own (then GPT-2's byte-level split), so a newline "
                "never merges with the next line's indentation: `\\n    return` is `Ċ` `ĠĠĠ` `Ġreturn`, "
                "and a prompt ending in a newline ends on a token training saw before indented lines")
    return "GPT-2's byte-level split (`\\n    ` merges into one token)"


def _where(rec: dict) -> str:
    device = rec.get("device", "cpu")
    return f"{rec['recipe']['threads']} CPU thread(s)" if device == "cpu" else device


def _prompt_score(rec: dict) -> str:
    s = rec.get("prompt_score")
    if not s:
        return ""
    curve = ", ".join(f"{step}: {a}+{b}" for step, a, b in rec.get("prompt_evals", []))
    return f"""
On the 16 code prompts of `tools/default_model_prompts.json` (written before any model's output
on them was seen; 8 end where a line ends, 8 after a newline), the greedy completions (64 tokens,
transformers, no token healing) of these weights parse as Python, cut after their last complete
line, for **{s["total"]}/16**: {s["line_end"]}/8 ending where a line ends, {s["after_newline"]}/8
after a newline (per checkpoint, step: line end + after newline: {curve}).
`python tools/default_model_eval.py pdkv/data/pdkv-stdlib-coder` prints them, and the same
score from pdkv with token healing on and off.
"""


def _validation(rec: dict) -> str:
    v = rec.get("validation")
    if not v:
        return ""
    n = len(v["prompts"]["line_end"]) + len(v["prompts"]["after_newline"])
    curve = ", ".join(f"{step}: {a}+{b}" for step, a, b in v["evals"])
    if v["rule"].startswith("validation"):
        how = (f"the checkpoint whose greedy completions of {n} validation prompts parse most often (ties to "
               f"the lower held-out loss): step {v['chosen_step']}")
    else:
        how = f"the last checkpoint, step {v['chosen_step']}"
    return f"""
The shipped weights are {how}. The validation prompts come from the held-out files in the
evaluation prompts' shapes: one-line function headers (`def name(args):`, a method after its
`class ...:` line), and in 3 of every 8 a function from its header down to a block opener in its
body (`for`, `while`, `with`, their `async` forms, `try`, `if`), half ending where the last line ends and half after
its newline; they are listed in `training.json`, and the 16 evaluation prompts play no part in
the choice. Validation prompts parsing per checkpoint
(step: line end + after newline, of {n // 2} + {n // 2}): {curve}.
"""


def model_card(rec: dict) -> str:
    r, c = rec["recipe"], rec["corpus"]
    return f"""---
license: other
license_name: psf-2.0
language: [code]
library_name: transformers
pipeline_tag: text-generation
---
# pdkv-stdlib-coder

pdkv's default model: a tiny Llama-architecture code model, trained from scratch by
`tools/train_default_model.py` on the Python standard library, so that a fresh pdkv checkout
answers with readable Python without downloading anything. It is a toy (it completes Python in
the style of the stdlib, and does not know facts or follow instructions), but it is a real,
ordinary Hugging Face Llama folder: `transformers` loads it unchanged.

| | |
|---|---|
| architecture | `LlamaForCausalLM`, {r["num_layers"]} layers, hidden {r["hidden_size"]}, {r["num_heads"]} heads / {r["num_kv_heads"]} KV heads (GQA), MLP {r["intermediate_size"]}, tied embeddings |
| parameters | {rec["parameters"]:,} ({rec["weights_bytes"] / 1e6:.1f} MB of bfloat16 safetensors) |
| tokenizer | byte-level BPE, {r["vocab_size"]} tokens, trained with `tokenizers` on the first {r["tokenizer_chars"]:,} characters of the training files; `<|endoftext|>` = BOS (opens every document and a plain prompt), `<|im_start|>`/`<|im_end|>` = ChatML turns, `<|im_end|>` = EOS; pre-tokenizer: {_pre_tokenizer(r)} |
| context | trained on {r["context"]}-token windows (RoPE, max_position_embeddings {r["max_position_embeddings"]}) |
| training | {rec["steps_done"]} steps{"" if rec["steps_done"] == r["steps"] else f" (checkpoint of a {r['steps']}-step schedule)"} of {r["batch_size"]} x {r["context"]} tokens = {rec["train_tokens"]:,} tokens, AdamW (lr {r["lr"]}, betas {tuple(r["betas"])}, weight decay {r["weight_decay"]}, {r["warmup_steps"]} warm-up steps, cosine to {r["min_lr_ratio"]} x lr, grad clip {r["grad_clip"]}), seed {r["seed"]}, float32 on {_where(rec)}, {rec["train_seconds"] / 60:.1f} min |
| final train loss | {rec["final_train_loss"]:.4f} nats/token (mean of the last 50 steps) |
| held-out loss | **{rec["heldout_loss"]:.4f}** nats/token on `heldout.txt` ({rec["heldout_tokens"]:,} tokens), measured on the shipped bfloat16 weights run in float32 ({rec["heldout_loss"] * rec["heldout_tokens"] / rec["heldout_chars"]:.4f} nats per character of `heldout.txt`, the figure that compares across tokenizers) |

## Data

The `.py` files of CPython {c["python"]}'s standard library, minus the top-level entries
{", ".join(f"`{x}`" for x in c["excluded_top_level"])} and every `test`/`tests` folder:
{c["train_files"]} training files ({c["train_chars"]:,} characters; corpus SHA-256 `{c["sha256"]}` over
paths and file hashes). Training documents are the files ({c["code_tokens"]:,} tokens) plus ChatML
samples made from their documented functions ({c["chat_tokens"]:,} tokens): the user turn is a
function's header and docstring, the assistant turn is the whole function. Documents are
shuffled with the seed, joined after a BOS each, and batches are random {r["context"] + 1}-token
windows of that stream.

Held out: the files whose path has `{c["heldout_rule"]}` ({len(c["heldout_files"])} files:
{", ".join(f"`{p}`" for p in c["heldout_files"])}). Their text (each after a `# file: PATH` line,
cut at {rec["heldout_chars"]:,} characters) is shipped as `heldout.txt`,
so the held-out loss can be re-measured on any machine: tokenize it with BOS, cut into
{r["context"]}-token rows (tail dropped), mean cross-entropy of tokens 1.. of each row.
`tests/default_model/` does exactly that and checks it matches the number above within 1%.

## Chat template

ChatML, opened by BOS: `<|endoftext|><|im_start|>user\\n...<|im_end|>\\n<|im_start|>assistant\\n`.
It saw such turns in training (a function's header and docstring in, the function out), but it
is too small to follow them well; completing code through `/v1/completions` works better.

## What to expect

Greedy completions are Python in the stdlib's voice — mostly docstrings, often repetitive, not
working code. `tests/default_model` checks that completions of fixed code prompts parse as
Python (cut at their last complete line) for most of them, and that untrained weights of the
same shape fail that check.
{_prompt_score(rec)}{_validation(rec)}
## License

The training text is the Python standard library, © Python Software Foundation, under the
PSF License Agreement (PSF-2.0). These weights and this card are distributed under the same
terms as pdkv.

All numbers here are written by the training script (`training.json` has the full record).
"""


def save_png(path: Path, curve, evals, r) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    k = max(1, len(curve) // 100)
    smooth = [sum(curve[i:i + k]) / len(curve[i:i + k]) for i in range(0, len(curve), k)]
    fig, ax = plt.subplots(figsize=(7, 4), dpi=100)
    ax.plot(range(1, len(curve) + 1), curve, color="#bbb", lw=0.6, label="train (per step)")
    ax.plot([i + k for i in range(0, len(curve), k)], smooth, color="#1f77b4", label=f"train (mean of {k})")
    ax.plot([s for s, _ in evals], [h for _, h in evals], "o-", color="#d62728", label="held-out")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.set_title(f"pdkv default model: {r.num_layers}x{r.hidden_size} Llama on the Python stdlib")
    ax.set_ylim(top=min(max(curve), 9.0))
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)


def main(argv: list[str]) -> int:
    folder = Path(argv[0])
    (folder / "README.md").write_text(model_card(json.loads((folder / "training.json").read_text())))
    print(folder / "README.md")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
