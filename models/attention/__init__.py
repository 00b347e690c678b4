"""Attention backends chosen by name. A backend module imports its heavy dependency only when
the backend is built, so ``torch`` works where ``flashinfer`` cannot even be imported."""

from __future__ import annotations

from pdkv.models.attention.base import AttentionBackend, AttentionBatch

ATTENTION_BACKENDS: dict[str, type[AttentionBackend]] = {}


def register(name: str):
    def wrap(cls):
        ATTENTION_BACKENDS[name] = cls
        cls.name = name
        return cls
    return wrap


def get_backend(name: str) -> type[AttentionBackend]:
    if name not in ATTENTION_BACKENDS:
        raise ValueError(f"model.attention_backend: unknown backend {name!r} "
                         f"(available: {', '.join(sorted(ATTENTION_BACKENDS))})")
    return ATTENTION_BACKENDS[name]


# Registration happens on import; neither module imports flashinfer at import time.
from pdkv.models.attention import flashinfer_backend as _fi  # noqa: E402,F401
from pdkv.models.attention import torch_backend as _torch  # noqa: E402,F401

__all__ = ["ATTENTION_BACKENDS", "AttentionBackend", "AttentionBatch", "get_backend", "register"]
