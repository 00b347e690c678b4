"""Model families (one file each), the Hugging Face folder loader and attention backends."""

from pdkv.models import deepseek_v3, llama, mistral, qwen2, qwen3, qwen3_moe  # noqa: F401 - registers the families
from pdkv.models.loader import LoadedModel, load_model
from pdkv.models.registry import MODEL_REGISTRY, supported_architectures

__all__ = ["MODEL_REGISTRY", "LoadedModel", "load_model", "supported_architectures"]
