"""Environment variables, in one place, with one prefix (``PDKV_``), read once at import.

Code reads ``pdkv.env.ENV.<name>`` rather than ``os.environ`` so that every knob is listed here
with its type and default. Tests that need another value pass it explicitly to the function
that uses it (``ensure_default_model(cache_dir=...)``) instead of patching the environment.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Env:
    cache_dir: Path  # PDKV_CACHE_DIR: where the embedded default model is built (~/.cache/pdkv)
    log_level: str  # PDKV_LOG_LEVEL: debug | info | warning | error (info)
    no_verbs: bool  # PDKV_NO_VERBS: build without the verbs transport even where libibverbs exists


def _flag(value: str | None) -> bool:
    return (value or "").strip().lower() not in ("", "0", "false", "no", "off")


def read_env(environ: dict[str, str] | os._Environ = os.environ) -> Env:
    """Parse the ``PDKV_*`` variables; bad values are a clear error naming the variable."""
    level = environ.get("PDKV_LOG_LEVEL", "info").strip().lower()
    if level not in ("debug", "info", "warning", "error"):
        raise ValueError(f"PDKV_LOG_LEVEL must be debug, info, warning or error, got {level!r}")
    cache = environ.get("PDKV_CACHE_DIR") or os.path.join(
        environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "pdkv")
    return Env(cache_dir=Path(cache).expanduser(), log_level=level, no_verbs=_flag(environ.get("PDKV_NO_VERBS")))


ENV = read_env()
