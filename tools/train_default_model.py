"""Trains pdkv's default model: a tiny Llama code model, on the Python standard library.

The corpus is on every machine that can run pdkv — the ``.py`` sources of the running Python's
standard library (PSF license) — so the model can be rebuilt anywhere without a download:

    nice -n 10 python tools/train_default_model.py  # writes pdkv/data/pdkv-stdlib-coder

Everything that decides the result is fixed here and written to the folder's ``training.json``
and model card: the seeds, the corpus (file list and its SHA-256), the tokenizer and model
shapes, every optimiser setting and the step count. Same Python version + same torch build give
the same tokens; floating point on other CPUs may drift in the last bits.

A larger model, with the same script: ``--recipe hidden_size=512 --recipe num_layers=8 ...``
overrides Recipe fields (recorded like the rest) and ``--device cuda`` trains on a GPU (not
bit-reproducible there: cuBLAS picks kernels per machine); the saved folder is scored on the CPU.

What it writes is an ordinary Hugging Face Llama folder (config.json, bfloat16 safetensors,
tokenizer.json + tokenizer_config.json with a ChatML template, generation_config.json), plus
``heldout.txt``: the held-out text the card's loss was measured on, shipped so the check does
not depend on the machine's stdlib version. ``--loss-png`` saves the loss curve.

The tokenizer's pre-tokenizer keeps every newline apart from the indentation after it
(``Recipe.pre_tokenizer``): with GPT-2's split, ``"\\n    return"`` is ``ĊĠĠĠ`` ``Ġreturn``, so a
prompt ending in a newline ends on a bare ``Ċ`` that training only ever saw before unindented
text, and the model jumped back to column 0. Each checkpoint also scores the 16 code prompts of
``tools/default_model_prompts.json`` (``tools/default_model_eval.py``; half end after a newline)
and records it in ``training.json`` and the card.
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import json
import math
import random
import shutil
import sys
import sysconfig
import tempfile
import textwrap
import time
import zlib
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run as a script from a checkout: `import pdkv.default_model` works

from pdkv.default_model import (BOS, EOS, SPECIAL_TOKENS, heldout_loss, heldout_windows,  # noqa: E402
                                model_card_numbers)
from default_model_card import model_card, save_png  # noqa: E402 - beside this script in tools/
from default_model_eval import score as prompt_score  # noqa: E402

# Top-level stdlib entries left out: the test suite (half the stdlib, and odd code on purpose),
# codec tables, generated doc strings, the 2to3 fixers' fixtures, and tkinter: its hundreds of
# near-identical `self.tk.call(...)` wrappers are what a small model learns to repeat, and
# greedy completions of unrelated prompts looped on them.
EXCLUDE_TOP = {"test", "encodings", "pydoc_data", "lib2to3", "site-packages", "__phello__", "idlelib",
               "tkinter"}
HELDOUT_MOD = 40  # a file is held out when crc32(its path) % HELDOUT_MOD == 0
HELDOUT_CHARS = 24_000  # how much of the held-out files is shipped as heldout.txt
SHIP = ("validation", "last")  # Recipe.ship's choices (pick_checkpoint)
# The block openers of the validation prompts: compound statements whose body is indented below
BLOCKS = (ast.For, ast.AsyncFor, ast.While, ast.With, ast.AsyncWith, ast.Try, ast.If)
BLOCK_SPAN = 6  # at most this many lines from a function's header to the block opener


@dataclass(frozen=True)
class Recipe:
    """Every hyper-parameter of a run; saved as training.json beside the weights."""

    seed: int = 0
    vocab_size: int = 4096
    tokenizer_chars: int = 6_000_000  # the tokenizer learns its merges from this much train text
    hidden_size: int = 128
    num_layers: int = 6
    num_heads: int = 4
    num_kv_heads: int = 2
    intermediate_size: int = 384
    context: int = 256
    batch_size: int = 8
    steps: int = 2000
    lr: float = 5e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 80
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.95)
    grad_clip: float = 1.0
    chat_fraction: float = 0.25  # share of the training tokens that are ChatML function samples
    threads: int = 1  # a shared machine: one thread is not starved by spinning on the other
    eval_every: int = 250
    max_position_embeddings: int = 2048
    rope_theta: float = 10000.0
    # "newline-apart": every "\n" is a pre-token of its own, so a newline never merges with the
    # indentation after it and a prompt ending in "\n" ends on a token training saw before
    # indented lines too. "gpt2": the plain byte-level split ("\n    " one token).
    pre_tokenizer: str = "newline-apart"
    # Which checkpoint is shipped. "validation": the one whose greedy completions of the
    # validation prompts (headers and block openers from the held-out files, never trained on) parse
    # most often, ties to the lower held-out loss -- chosen without the 16 evaluation prompts,
    # which would be choosing on the test set. "last": the end of the schedule.
    ship: str = "validation"
    validation_prompts: int = 64  # half end where their last line ends, half after its newline
    extra: dict = field(default_factory=dict)


def stdlib_files() -> list[tuple[str, str]]:
    """(relative path, text) of the stdlib's .py files, in sorted path order."""
    root = Path(sysconfig.get_path("stdlib"))
    out = []
    for f in sorted(root.rglob("*.py")):
        rel = f.relative_to(root).as_posix()
        parts = rel.split("/")
        if parts[0] in EXCLUDE_TOP or any(p in ("test", "tests") for p in parts[:-1]):
            continue
        try:
            text = f.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        if text.strip():
            out.append((rel, text))
    return out


def split(files):
    held = [(r, t) for r, t in files if zlib.crc32(r.encode()) % HELDOUT_MOD == 0]
    train = [(r, t) for r, t in files if zlib.crc32(r.encode()) % HELDOUT_MOD != 0]
    return train, held


def validation_prompts(held, n: int, seed: int) -> dict[str, list[str]]:
    """Code prompts from the held-out files only, in the evaluation prompts' shapes: the one-line
    headers of their functions, ``def name(args):`` (a method after its one-line ``class ...:``
    header, indented), and -- 3 in 8 of each group, as in the evaluation -- a function from its
    header down to a block opener in its body (``for ...:``, ``with ...:``, ``try:``, ...), at most
    ``BLOCK_SPAN`` lines, as written. Deduplicated, shuffled with ``seed``; the first n/2 end where
    the last line ends, the next n/2 after its newline -- on code the model never saw."""
    if n < 2 or n % 2:
        raise ValueError(f"Recipe.validation_prompts must be an even number >= 2, got {n}")
    heads, blocks = set(), set()
    for rel, text in held:
        try:
            tree = ast.parse(text)
        except SyntaxError:
            continue
        lines = text.splitlines()

        def one_line(node) -> str | None:
            line = lines[node.lineno - 1].strip()
            # a header on one line, with a body on the lines after it (not `def f(): pass`)
            return line if line.endswith(":") and node.body[0].lineno > node.lineno else None

        def openers(fn, prefix: str):
            if not one_line(fn) or fn.decorator_list:
                return
            for stmt in fn.body:
                if (isinstance(stmt, BLOCKS) and one_line(stmt)
                        and stmt.lineno - fn.lineno < BLOCK_SPAN):
                    blocks.add(prefix + "\n".join(lines[fn.lineno - 1:stmt.lineno]))

        for node in tree.body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                if one_line(node):
                    heads.add(one_line(node))
                openers(node, "")
        for cls in ast.walk(tree):
            if not isinstance(cls, ast.ClassDef) or not one_line(cls):
                continue
            for node in cls.body:
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and one_line(node):
                    heads.add(f"{one_line(cls)}\n    {one_line(node)}")
                    if cls in tree.body:  # its methods' lines as written sit one indent in
                        openers(node, one_line(cls) + "\n")
    heads, blocks = sorted(heads), sorted(blocks)
    half = n // 2
    n_blocks = half * 3 // 8
    if len(heads) < 2 * (half - n_blocks) or len(blocks) < 2 * n_blocks:
        raise ValueError(f"the held-out files have {len(heads)} one-line function headers and "
                         f"{len(blocks)} block openers, fewer than Recipe.validation_prompts={n} needs")
    rng = random.Random(seed)
    rng.shuffle(heads)
    rng.shuffle(blocks)
    k = half - n_blocks
    return {"line_end": heads[:k] + blocks[:n_blocks],
            "after_newline": [p + "\n" for p in heads[k:2 * k] + blocks[n_blocks:2 * n_blocks]]}


def pick_checkpoint(checkpoints: list[dict], ship: str) -> dict:
    """The checkpoint to ship from ``[{"step", "heldout_loss", "validation": {"total", ...}}]``:
    "last" is the final one; "validation" the most validation prompts parsing, ties to the lower
    held-out loss, then to the later step."""
    if not checkpoints:
        raise ValueError("no checkpoint to ship: training saved none")
    if ship == "last":
        return checkpoints[-1]
    if ship == "validation":
        return min(checkpoints, key=lambda c: (-c["validation"]["total"], c["heldout_loss"], -c["step"]))
    raise ValueError(f"Recipe.ship: {ship!r} is not 'validation' or 'last'")


def chat_samples(text: str) -> list[str]:
    """ChatML samples from one file: the user gives a function's header and docstring, the
    assistant writes the whole function. This is what the chat template is for in the demo."""
    try:
        tree = ast.parse(text)
    except SyntaxError:
        return []
    lines = text.splitlines()
    out = []
    for node in ast.walk(tree):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or node.decorator_list:
            continue
        doc = node.body[0] if node.body else None
        if not (isinstance(doc, ast.Expr) and isinstance(getattr(doc, "value", None), ast.Constant)
                and isinstance(doc.value.value, str)) or len(node.body) < 2:
            continue
        src = textwrap.dedent("\n".join(lines[node.lineno - 1:node.end_lineno]))
        head = textwrap.dedent("\n".join(lines[node.lineno - 1:doc.end_lineno]))
        if len(src) > 1500:
            continue
        out.append(f"<|im_start|>user\n{head}<|im_end|>\n<|im_start|>assistant\n{src}<|im_end|>\n")
    return out


def train_tokenizer(texts: list[str], r: Recipe):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False)
    if r.pre_tokenizer == "newline-apart":
        tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split("\n", "isolated"), byte_level])
    elif r.pre_tokenizer == "gpt2":
        tok.pre_tokenizer = byte_level
    else:
        raise ValueError(f"Recipe.pre_tokenizer: {r.pre_tokenizer!r} is not 'newline-apart' or 'gpt2'")
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=r.vocab_size, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    budget, sample = r.tokenizer_chars, []
    for t in texts:
        if budget <= 0:
            break
        sample.append(t[:budget])
        budget -= len(sample[-1])
    tok.train_from_iterator(sample, trainer)
    # A plain prompt starts with BOS, as every training document does (add_special_tokens=True).
    bos_id = tok.token_to_id(BOS)
    tok.post_processor = processors.TemplateProcessing(single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B",
                                                       special_tokens=[(BOS, bos_id)])
    return tok


def token_stream(train, tok, r: Recipe):
    """One long stream: files and chat samples, shuffled (seeded), each after a BOS."""
    import numpy as np

    rng = random.Random(r.seed)
    docs = [t for _, t in train]
    code_ids = [tok.encode(d, add_special_tokens=False).ids for d in docs]
    n_code = sum(len(x) + 1 for x in code_ids)
    chats = [c for d in docs for c in chat_samples(d)]
    rng.shuffle(chats)
    chat_ids, n_chat = [], 0
    want = r.chat_fraction / (1 - r.chat_fraction) * n_code
    for c in chats:
        if n_chat >= want:
            break
        chat_ids.append(tok.encode(c, add_special_tokens=False).ids)
        n_chat += len(chat_ids[-1]) + 1
    all_docs = code_ids + chat_ids
    rng.shuffle(all_docs)
    bos = tok.token_to_id(BOS)
    flat = []
    for d in all_docs:
        flat.append(bos)
        flat.extend(d)
    return np.asarray(flat, dtype=np.int32), n_code, n_chat


def build_model(r: Recipe, tok):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(r.seed)
    cfg = LlamaConfig(
        vocab_size=tok.get_vocab_size(), hidden_size=r.hidden_size, intermediate_size=r.intermediate_size,
        num_hidden_layers=r.num_layers, num_attention_heads=r.num_heads, num_key_value_heads=r.num_kv_heads,
        head_dim=r.hidden_size // r.num_heads, max_position_embeddings=r.max_position_embeddings,
        rms_norm_eps=1e-6, rope_theta=r.rope_theta, tie_word_embeddings=True, hidden_act="silu",
        bos_token_id=tok.token_to_id(BOS), eos_token_id=[tok.token_to_id(EOS), tok.token_to_id(BOS)],
        pad_token_id=tok.token_to_id(BOS), attention_bias=False, mlp_bias=False,
    )
    return LlamaForCausalLM(cfg)


def lr_at(step: int, r: Recipe) -> float:
    if step < r.warmup_steps:
        return r.lr * (step + 1) / r.warmup_steps
    p = (step - r.warmup_steps) / max(1, r.steps - r.warmup_steps)
    return r.lr * (r.min_lr_ratio + (1 - r.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * p)))


def recipe_from(overrides: list[str], **base) -> Recipe:
    """Recipe with ``KEY=VALUE`` overrides (``--recipe hidden_size=512``), each value read as the
    field's type; an error names the field. How a larger model is trained with the same script."""
    kinds = {f.name: type(f.default) for f in fields(Recipe) if f.name not in ("betas", "extra")}
    values = dict(base)
    for item in overrides:
        key, eq, raw = item.partition("=")
        if not eq or key not in kinds:
            raise SystemExit(f"--recipe {item!r}: expected KEY=VALUE with KEY one of {', '.join(sorted(kinds))}")
        try:
            values[key] = kinds[key](raw) if kinds[key] is not bool else raw.lower() in ("1", "true", "yes")
        except ValueError:
            raise SystemExit(f"--recipe {item!r}: {key} must be a {kinds[key].__name__}") from None
    return Recipe(**values)


def pick_device(name: str):
    import torch

    if name == "cpu":
        return torch.device("cpu")
    if name == "cuda":
        if not torch.cuda.is_available():
            raise SystemExit("--device cuda: torch has no CUDA device here (a CPU build, or no GPU); use --device cpu")
        return torch.device("cuda")
    raise SystemExit(f"--device must be cpu or cuda, got {name!r}")


def train(model, stream, r: Recipe, checkpoint):
    """The training loop; ``checkpoint(step, curve, train_s, tokens) -> held-out loss`` saves the
    folder every ``eval_every`` steps (so a usable model exists long before the end)."""
    import numpy as np
    import torch
    from tqdm import tqdm

    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": r.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=r.lr, betas=r.betas)
    rng = np.random.default_rng(r.seed)
    curve, evals, t0, tokens = [], [], time.perf_counter(), 0
    bar = tqdm(range(r.steps), desc="train", mininterval=2.0, file=sys.stdout)
    for step in bar:
        for g in opt.param_groups:
            g["lr"] = lr_at(step, r)
        starts = rng.integers(0, len(stream) - r.context - 1, size=r.batch_size)
        batch = torch.from_numpy(np.stack([stream[s:s + r.context + 1] for s in starts]).astype(np.int64))
        batch = batch.to(next(model.parameters()).device)
        model.train()
        logits = model(input_ids=batch[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(),
                                                 batch[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), r.grad_clip)
        opt.step()
        tokens += batch[:, :-1].numel()
        curve.append(float(loss.detach()))
        elapsed = time.perf_counter() - t0
        bar.set_postfix(loss=f"{curve[-1]:.3f}", tok_s=f"{tokens / elapsed:.0f}")
        if (step + 1) % r.eval_every == 0 or step + 1 == r.steps:
            t_save = time.perf_counter()
            h = checkpoint(step + 1, curve, elapsed, tokens)
            bar.write(f"step {step + 1}/{r.steps}  train loss {sum(curve[-r.eval_every:]) / len(curve[-r.eval_every:]):.4f}"
                      f"  held-out loss {h:.4f}  {tokens / elapsed:.0f} tokens/s  {elapsed:.0f} s")
            t0 += time.perf_counter() - t_save  # saving is not training time
    return curve


def write_folder(out: Path, model, tok, heldout_text: str, record: dict):
    """Saves the HF folder with bfloat16 weights; returns the held-out loss of those weights
    (re-read from disk, so the card's number is the shipped file's, not the float32 model's)
    and the re-read model."""
    import torch
    from transformers import LlamaForCausalLM

    from pdkv.default_model import CHAT_TEMPLATE, shipped_heldout_windows

    model.config.torch_dtype = "bfloat16"
    model.to(torch.bfloat16).save_pretrained(out, safe_serialization=True)
    model.to(torch.float32)
    cfg = json.loads((out / "config.json").read_text())
    cfg["torch_dtype"] = cfg.get("dtype", "bfloat16")  # pdkv and older transformers read this key
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": BOS, "eos_token": EOS,
        "pad_token": BOS, "add_bos_token": True, "model_max_length": cfg["max_position_embeddings"],
        "chat_template": CHAT_TEMPLATE}, indent=2) + "\n")
    eos_ids = [tok.token_to_id(EOS), tok.token_to_id(BOS)]
    (out / "generation_config.json").write_text(json.dumps({
        "bos_token_id": tok.token_to_id(BOS), "eos_token_id": eos_ids, "pad_token_id": tok.token_to_id(BOS),
        "do_sample": False}, indent=2) + "\n")
    (out / "heldout.txt").write_text(heldout_text, encoding="utf-8")
    (out / "training.json").write_text(json.dumps(record, indent=2) + "\n")
    shipped = LlamaForCausalLM.from_pretrained(out, dtype=torch.float32)
    windows = shipped_heldout_windows(out)
    final = heldout_loss(shipped, windows)
    return final, shipped


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(ROOT / "pdkv" / "data" / "pdkv-stdlib-coder"))
    ap.add_argument("--loss-png", default=str(ROOT / "docs" / "default_model_loss.png"))
    ap.add_argument("--steps", type=int, default=Recipe.steps)
    ap.add_argument("--batch-size", type=int, default=Recipe.batch_size)
    ap.add_argument("--eval-every", type=int, default=Recipe.eval_every)
    ap.add_argument("--recipe", action="append", default=[], metavar="KEY=VALUE",
                    help="override a Recipe field (repeatable), e.g. hidden_size=512 num_layers=8")
    ap.add_argument("--device", default="cpu", help="cpu (default) or cuda: where the model trains; "
                    "the saved weights are scored on the CPU either way")
    ap.add_argument("--checkpoints", default="", metavar="DIR",
                    help="keep every checkpoint's folder here (default: a temporary folder, removed "
                         "once the chosen one is copied to --out)")
    ap.add_argument("--trial", type=float, default=0.0,
                    help="only measure: train this many seconds, print tokens/s, write nothing")
    a = ap.parse_args(argv)
    import torch

    r = recipe_from(a.recipe, steps=a.steps, batch_size=a.batch_size, eval_every=a.eval_every)
    if r.ship not in SHIP:
        raise SystemExit(f"--recipe ship={r.ship}: expected one of {', '.join(SHIP)}")  # now, not after training
    device = pick_device(a.device)
    torch.set_num_threads(r.threads)
    random.seed(r.seed)
    t_start = time.perf_counter()
    files = stdlib_files()
    train_files, held_files = split(files)
    corpus_sha = hashlib.sha256("\n".join(f"{p}\0{hashlib.sha256(t.encode()).hexdigest()}"
                                          for p, t in files).encode()).hexdigest()
    print(f"corpus: {len(train_files)} train files, {len(held_files)} held-out files "
          f"({sum(len(t) for _, t in train_files) / 1e6:.1f} M chars), sha256 {corpus_sha[:16]}", flush=True)
    tok = train_tokenizer([t for _, t in train_files], r)
    heldout_text = "".join(f"# file: {p}\n{t}\n" for p, t in held_files)[:HELDOUT_CHARS]
    heldout_ids = heldout_windows(tok.encode(heldout_text).ids, r.context)
    stream, n_code, n_chat = token_stream(train_files, tok, r)
    val = validation_prompts(held_files, r.validation_prompts, r.seed)
    print(f"tokenizer: {tok.get_vocab_size()} tokens; stream {len(stream) / 1e6:.2f} M tokens "
          f"({n_code} code, {n_chat} chat); held-out {heldout_ids.numel()} tokens "
          f"[{time.perf_counter() - t_start:.0f} s]", flush=True)
    model = build_model(r, tok).to(device)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: {n_params / 1e6:.2f} M parameters", flush=True)
    if a.trial:
        import numpy as np
        rng, t0, n = np.random.default_rng(0), time.perf_counter(), 0
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        while time.perf_counter() - t0 < a.trial:
            s = rng.integers(0, len(stream) - r.context - 1, size=r.batch_size)
            b = torch.from_numpy(np.stack([stream[i:i + r.context + 1] for i in s]).astype(np.int64)).to(device)
            logits = model(input_ids=b[:, :-1]).logits
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), b[:, 1:].reshape(-1))
            opt.zero_grad()
            loss.backward()
            opt.step()
            n += b[:, :-1].numel()
        print(f"trial: {n / (time.perf_counter() - t0):.0f} tokens/s, loss {float(loss.detach()):.3f}")
        return 0
    base = dict(recipe=asdict(r), parameters=n_params, corpus=dict(
        python=sys.version.split()[0], stdlib=sysconfig.get_path("stdlib"), sha256=corpus_sha,
        excluded_top_level=sorted(EXCLUDE_TOP), heldout_rule=f"crc32(path) % {HELDOUT_MOD} == 0",
        train_files=len(train_files), heldout_files=[p for p, _ in held_files],
        train_chars=sum(len(t) for _, t in train_files), stream_tokens=int(len(stream)),
        code_tokens=n_code, chat_tokens=n_chat), heldout_chars=len(heldout_text), torch=torch.__version__,
        device=str(device) if device.type == "cpu" else f"{device} ({torch.cuda.get_device_name(device)})")
    out = Path(a.out)
    if a.checkpoints:
        ckpt_root, tmp = Path(a.checkpoints), None
        ckpt_root.mkdir(parents=True, exist_ok=True)
    else:
        tmp = tempfile.TemporaryDirectory(prefix="pdkv-checkpoints-")
        ckpt_root = Path(tmp.name)
    try:
        _train_and_ship(a, r, out, ckpt_root, model, tok, stream, heldout_text, heldout_ids, val, base)
    finally:
        if tmp is not None:
            tmp.cleanup()
    rec = model_card_numbers(out)
    print(f"done: shipped step {rec['steps_done']} ({r.ship}); held-out loss of the saved bfloat16 weights "
          f"{rec['heldout_loss']:.4f}; {rec['train_seconds'] / 60:.1f} min of training, "
          f"{rec['train_tokens'] / 1e6:.2f} M tokens", flush=True)
    return 0


def _train_and_ship(a, r: Recipe, out: Path, ckpt_root: Path, model, tok, stream, heldout_text, heldout_ids,
                    val: dict[str, list[str]], base: dict) -> None:
    """Trains, saving every checkpoint as its own folder under ``ckpt_root`` (scored on the
    held-out loss, the validation prompts and -- reported, never used to choose -- the 16
    evaluation prompts), then copies the one ``Recipe.ship`` picks to ``out``."""
    evals: list[tuple[int, float]] = []
    prompt_evals: list[tuple[int, int, int]] = []  # (step, line_end parsing, after_newline parsing)
    val_evals: list[tuple[int, int, int]] = []  # the same on the validation prompts
    saved: list[dict] = []

    def checkpoint(step, curve, train_s, tokens) -> float:
        t = time.perf_counter()
        folder = ckpt_root / f"step-{step:05d}"
        folder.mkdir(parents=True, exist_ok=True)
        record = dict(base, steps_done=step, train_tokens=tokens, train_seconds=round(train_s, 1),
                      final_train_loss=round(sum(curve[-50:]) / len(curve[-50:]), 4))
        h, shipped = write_folder(folder, model, tok, heldout_text, record)
        evals.append((step, round(h, 5)))
        v = prompt_score(shipped, tok, groups=val)
        val_evals.append((step, v["line_end"], v["after_newline"]))
        # the evaluation prompts too, for the record: the held-out loss alone does not say
        # whether completions read as Python (the choice of checkpoint uses the validation only)
        s = prompt_score(shipped, tok)
        prompt_evals.append((step, s["line_end"], s["after_newline"]))
        record.update(heldout_loss=round(h, 5), heldout_tokens=int(heldout_ids.numel()),
                      weights_bytes=(folder / "model.safetensors").stat().st_size, prompt_score=s,
                      validation_score={k: v[k] for k in ("line_end", "after_newline", "total")})
        (folder / "training.json").write_text(json.dumps(record, indent=2) + "\n")
        saved.append(dict(step=step, heldout_loss=h, validation=v, folder=folder))
        print(f"saved {folder} at step {step}: validation prompts parse {v['line_end']}+{v['after_newline']}"
              f"/{len(val['line_end']) + len(val['after_newline'])}, evaluation prompts {s['line_end']}/8 "
              f"line end + {s['after_newline']}/8 after newline ({time.perf_counter() - t:.0f} s)", flush=True)
        return h

    curve = train(model, stream, r, checkpoint)
    best = pick_checkpoint(saved, r.ship)
    out.mkdir(parents=True, exist_ok=True)
    for f in best["folder"].iterdir():
        shutil.copyfile(f, out / f.name)
    rec = json.loads((out / "training.json").read_text())
    rec.update(evals=evals, prompt_evals=prompt_evals, validation=dict(
        rule=f"{r.ship}: " + ("most validation prompts parsing, ties to the lower held-out loss"
                              if r.ship == "validation" else "the last checkpoint"),
        prompts=val, evals=val_evals, chosen_step=best["step"]))
    (out / "training.json").write_text(json.dumps(rec, indent=2) + "\n")
    (out / "README.md").write_text(model_card(rec))
    if a.loss_png:
        save_png(Path(a.loss_png), curve, evals, r)
    print(f"shipped step {best['step']} to {out}", flush=True)


if __name__ == "__main__":
    raise SystemExit(main())
