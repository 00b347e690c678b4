"""The default model: a tiny trained Llama code model that ships inside the package.

``configs/colocated.yaml`` leaves ``model.path`` empty, and the engine then serves this folder,
so a fresh clone (or an installed pdkv) answers requests without downloading or building
anything. It is an ordinary Hugging Face Llama folder in ``pdkv/data/pdkv-stdlib-coder`` —
``transformers`` loads it unchanged — trained on the Python standard library by
``tools/train_default_model.py``; its model card (``README.md`` in the folder) records the data,
size, steps and losses. Serve a real folder with ``--set model.path=/models/...``.

The held-out check lives here too, because it is what makes "the shipped weights are the trained
ones" testable: ``heldout.txt`` ships in the folder (the stdlib differs between Python versions)
and ``heldout_loss`` must give the card's number.

The random-weight generator (``pdkv.tiny_model``) stays for tests that need odd shapes.
"""

from __future__ import annotations

import json
from pathlib import Path

# Special tokens of the trained tokenizer. BOS opens every training document (and a plain
# prompt, through the tokenizer's post-processor); <|im_start|>/<|im_end|> frame ChatML turns.
BOS = "<|endoftext|>"
EOS = "<|im_end|>"
SPECIAL_TOKENS = [BOS, "<|im_start|>", EOS]
CHAT_TEMPLATE = ("{{ bos_token }}{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
                 "{{ message['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
NAME = "pdkv-stdlib-coder"  # the folder's name is the served model name (/v1/models)
DEFAULT_MODEL_DIR = Path(__file__).resolve().parent / "data" / NAME


def default_model_dir(cache_dir=None) -> Path:
    """Where the default model lives: inside the package. ``cache_dir`` is accepted for the
    callers of the old built-on-first-use model and ignored (nothing is built any more)."""
    return DEFAULT_MODEL_DIR


def ensure_default_model(cache_dir=None) -> str:
    """The path of the shipped default model folder; a clear error if the install lacks it."""
    target = default_model_dir(cache_dir)
    missing = [f for f in ("config.json", "model.safetensors", "tokenizer.json") if not (target / f).is_file()]
    if missing:
        raise FileNotFoundError(
            f"{target}: the default model is incomplete (missing {', '.join(missing)}); reinstall pdkv "
            "or rebuild it with `python tools/train_default_model.py`")
    return str(target)


def model_card_numbers(folder: str | Path = DEFAULT_MODEL_DIR) -> dict:
    """The numbers the trainer recorded (training.json beside the weights)."""
    return json.loads((Path(folder) / "training.json").read_text(encoding="utf-8"))


def heldout_windows(ids: list[int], context: int):
    """The held-out token ids cut into rows of ``context`` tokens (the ragged tail is dropped),
    each row scored on its own: the model predicts tokens 1..context-1 from the ones before."""
    import torch  # noqa: PLC0415

    n = len(ids) // context
    if n == 0:
        raise ValueError(f"held-out text has {len(ids)} tokens, fewer than one window of {context}")
    return torch.tensor(ids[:n * context], dtype=torch.long).view(n, context)


def heldout_loss(model, windows, batch: int = 8) -> float:
    """Mean next-token cross-entropy (nats) of a ``transformers`` causal LM over ``windows``."""
    import torch  # noqa: PLC0415

    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    with torch.no_grad():
        for i in range(0, windows.shape[0], batch):
            rows = windows[i:i + batch]
            logits = model(input_ids=rows).logits.float()
            loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]),
                                                     rows[:, 1:].reshape(-1), reduction="sum")
            total += float(loss)
            count += rows[:, 1:].numel()
    model.train(was_training)
    return total / count


def shipped_heldout_windows(folder: str | Path = DEFAULT_MODEL_DIR):
    """The held-out windows of a model folder, exactly as the trainer scored them."""
    from tokenizers import Tokenizer  # noqa: PLC0415

    folder = Path(folder)
    card = model_card_numbers(folder)
    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    text = (folder / "heldout.txt").read_text(encoding="utf-8")
    return heldout_windows(tok.encode(text).ids, card["recipe"]["context"])


if __name__ == "__main__":
    print(ensure_default_model())
