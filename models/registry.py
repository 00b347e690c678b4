"""Architecture name (``config.json: architectures[0]``) → model class."""

from __future__ import annotations

MODEL_REGISTRY: dict[str, type] = {}


def register_model(architecture: str):
    def wrap(cls):
        MODEL_REGISTRY[architecture] = cls
        return cls
    return wrap


def supported_architectures() -> list[str]:
    import pdkv.models  # noqa: F401,PLC0415 - importing the package registers every family

    return sorted(MODEL_REGISTRY)
