"""The embedded default model: a small Llama-shaped folder the repo builds on first use.

``configs/colocated.yaml`` leaves ``model.path`` empty, and the engine then serves this model,
so a fresh clone answers requests without downloading anything. The weights are random (made
deterministically by ``pdkv.tiny_model.make_tiny_model``): the text is not meaningful, but every
part of the serving path — tokenizer, chat template, paged KV cache, scheduler, sampler, HTTP —
runs for real. Serve a real Hugging Face folder with ``--set model.path=/models/...``.

The size is chosen so that loading and generating on two CPU cores takes well under a second
per request (``make demo`` stays quick) while still having several layers, GQA and a vocabulary
large enough for a trained byte-level BPE.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from pathlib import Path

log = logging.getLogger(__name__)

# Bump VERSION when the recipe changes, so older caches are not reused.
VERSION = 1
SPEC = dict(
    arch="llama",
    hidden_size=256,
    num_layers=4,
    num_heads=8,
    num_kv_heads=4,
    intermediate_size=768,
    vocab_size=512,  # the trained byte-level BPE fills 512 (it runs out of merges near 615)
    max_position_embeddings=2048,
    dtype="float32",
    seed=0,
)
NAME = f"pdkv-tiny-llama-v{VERSION}"


def default_model_dir(cache_dir: str | Path | None = None) -> Path:
    """Where the default model lives (built or not): ``<cache>/models/<NAME>``."""
    if cache_dir is None:
        from pdkv.env import ENV

        cache_dir = ENV.cache_dir
    return Path(cache_dir).expanduser() / "models" / NAME


def ensure_default_model(cache_dir: str | Path | None = None) -> str:
    """Build the default model folder if it is not there yet; return its path.

    Safe when several processes race: each builds into its own temporary folder beside the
    target and renames it into place; a rename onto an existing folder fails, and the loser
    throws its copy away. A half-built folder is never visible under the final name.
    """
    target = default_model_dir(cache_dir)
    if (target / "config.json").is_file():
        return str(target)
    from pdkv.tiny_model import make_tiny_model  # lazily: it pulls tokenizers and safetensors

    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{NAME}.", dir=target.parent))
    try:
        log.info("building the embedded default model into %s", target)
        make_tiny_model(tmp, **SPEC)
        try:
            os.rename(tmp, target)
        except OSError:
            if not (target / "config.json").is_file():
                raise
            # Another process won the race; its folder is complete (renames are atomic).
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return str(target)


if __name__ == "__main__":
    print(ensure_default_model())
