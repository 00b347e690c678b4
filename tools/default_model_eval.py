"""The default model's code-prompt evaluation: greedy completions of the 16 prompts in
``default_model_prompts.json`` (beside this file; half end where a line ends, half after a
newline), each scored by whether the prompt plus the completion, cut after its last complete
line, parses as Python. ``tools/train_default_model.py`` records it at every checkpoint and
``tests/default_model`` checks it; ``python tools/default_model_eval.py FOLDER`` prints it.
"""

from __future__ import annotations

import ast
import json
import sys
from pathlib import Path

PROMPTS_FILE = Path(__file__).resolve().parent / "default_model_prompts.json"
NEW_TOKENS = 64  # enough for a line or three of code; the cut keeps only complete lines


def eval_prompts() -> dict[str, list[str]]:
    """{"line_end": [8 prompts], "after_newline": [8 prompts]}."""
    data = json.loads(PROMPTS_FILE.read_text(encoding="utf-8"))
    return {k: data[k] for k in ("line_end", "after_newline")}


def complete_lines(prompt: str, completion: str, finished: bool) -> str | None:
    """prompt + completion cut after its last complete line (all of it when the model ended
    the text itself); None when no new line of code came out."""
    text = prompt + completion
    if not finished:
        text = text[:text.rfind("\n") + 1]
    if not text[len(prompt):].strip():
        return None
    return text


def parses(prompt: str, completion: str, finished: bool) -> bool:
    text = complete_lines(prompt, completion, finished)
    if text is None:
        return False
    try:
        ast.parse(text)
    except SyntaxError:
        return False
    return True


def hf_complete(model, tokenizer, prompt: str, n: int = NEW_TOKENS) -> tuple[str, bool]:
    """transformers' greedy ``generate`` from a ``tokenizers.Tokenizer`` or a transformers
    tokenizer: (completion text, whether the model ended it on an EOS token)."""
    import torch

    fast = getattr(tokenizer, "_tokenizer", tokenizer)  # transformers wraps a tokenizers object
    eos = [fast.token_to_id(t) for t in ("<|im_end|>", "<|endoftext|>")]
    ids = torch.tensor([fast.encode(prompt).ids])
    was_training = model.training
    model.eval()
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                             do_sample=False, eos_token_id=eos, pad_token_id=eos[1])
    model.train(was_training)
    out = out[0, ids.shape[1]:].tolist()
    return fast.decode(out, skip_special_tokens=True), bool(out) and out[-1] in eos


def score(model, tokenizer, groups: dict[str, list[str]] | None = None) -> dict:
    """{group: k, ..., "total": k, "parsed": {prompt: bool}}: k prompts of each group parse.
    ``groups`` defaults to the 16 evaluation prompts ({"line_end": ..., "after_newline": ...});
    the trainer passes its validation prompts (from held-out files) the same way."""
    parsed = {}
    counts = {}
    for group, prompts in (eval_prompts() if groups is None else groups).items():
        if not prompts:
            raise ValueError(f"prompt group {group!r} is empty")
        ok = [parses(p, *hf_complete(model, tokenizer, p)) for p in prompts]
        parsed.update(zip(prompts, ok))
        counts[group] = sum(ok)
    return dict(counts, total=sum(counts.values()), parsed=parsed)


def engine_score(engine, token_healing: bool, n: int = NEW_TOKENS) -> dict:
    """The same score from a pdkv engine's greedy completions (what a client of
    ``/v1/completions`` gets: with healing, the text excludes what healing took off the
    prompt, so ``prompt + text`` is what is parsed)."""
    from pdkv.engine import SamplingParams

    params = SamplingParams(max_tokens=n, temperature=0.0, token_healing=token_healing)
    parsed, counts = {}, {}
    for group, prompts in eval_prompts().items():
        outs = engine.generate(prompts, params)
        ok = [parses(p, o.text, o.finish_reason == "stop") for p, o in zip(prompts, outs)]
        parsed.update(zip(prompts, ok))
        counts[group] = sum(ok)
    return dict(counts, total=sum(counts.values()), parsed=parsed)


def _engine(folder):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout
    from pdkv.config import KVCacheConfig, ModelConfig, SchedulerConfig
    from pdkv.engine import LLMEngine

    return LLMEngine(ModelConfig(path=str(folder)), KVCacheConfig(page_size=16, num_pages=256),
                     SchedulerConfig(), num_threads=1)


def main(argv: list[str]) -> int:
    import torch
    from tokenizers import Tokenizer
    from transformers import LlamaForCausalLM

    torch.set_num_threads(1)
    folder = Path(argv[0])
    model = LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32)
    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    for group, prompts in eval_prompts().items():
        for p in prompts:
            text, done = hf_complete(model, tok, p)
            print(f"--- [{group}] {'PARSES' if parses(p, text, done) else 'fails'} "
                  f"{'(EOS)' if done else ''}\n{p}\033[1m{text}\033[0m")
    s = score(model, tok)
    print(f"transformers, no healing: {s['total']}/16 (line_end {s['line_end']}/8, "
          f"after_newline {s['after_newline']}/8)")
    engine = _engine(folder)
    for heal in (False, True):
        s = engine_score(engine, heal)
        print(f"pdkv, token_healing={heal}: {s['total']}/16 (line_end {s['line_end']}/8, "
              f"after_newline {s['after_newline']}/8)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
