"""Model families (one file each), the Hugging Face folder loader and attention backends."""

from models import deepseek_v3, llama, mistral, qwen2, qwen3, qwen3_moe  # noqa: F401 - registers the families
from models.loader import LoadedModel, load_model
from models.registry import MODEL_REGISTRY, supported_architectures

__all__ = ["MODEL_REGISTRY", "LoadedModel", "load_model", "supported_architectures"]
