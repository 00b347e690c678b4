"""Role configs: YAML in, frozen dataclasses out.

The dataclasses below are the contract between the config loader, the engine and the server.
The engine is built from ``ModelConfig``, ``KVCacheConfig`` and ``SchedulerConfig``; the server
reads ``ServerConfig``; the messenger reads ``MessengerConfig``.

NOTE: YAML is only an input format. Derived values are properties, never stored twice.
"""

from __future__ import annotations

from dataclasses import dataclass, field

ROLES = ("colocated", "prefill", "decode")
DTYPES = ("float32", "bfloat16", "float16", "auto")
LAYOUTS = ("HND", "NHD")


@dataclass(frozen=True)
class ModelConfig:
    # A local Hugging Face model folder. Empty means the embedded default model, which the repo
    # builds on first use (see pdkv.default_model).
    path: str = ""
    dtype: str = "float32"
    device: str = "cpu"  # "cpu", "cuda", "cuda:N"
    attention_backend: str = "torch"  # a name in models.attention registry: torch | flashinfer
    max_model_len: int | None = None  # None: the model config's max_position_embeddings
    served_name: str | None = None  # name in /v1/models; None: the folder's name
    seed: int = 0


@dataclass(frozen=True)
class KVCacheConfig:
    page_size: int = 16  # tokens per page
    num_pages: int | None = None  # None: derived from memory_fraction (GPU) or memory_gib (CPU)
    memory_fraction: float = 0.85  # of free GPU memory, after weights
    memory_gib: float = 1.0  # CPU: KV cache size when num_pages is not set
    layout: str = "HND"  # HND: [pages, 2, kv_heads, P, head_dim]; NHD: [pages, 2, P, kv_heads, head_dim]


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_batched_tokens: int = 2048  # token budget per step (prefill chunks + decodes)
    chunk_size: int = 512  # most prefill tokens of one request in one step
    max_num_seqs: int = 64  # most running requests


@dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    max_body_bytes: int = 1 << 20


@dataclass(frozen=True)
class MessengerConfig:
    # Reserved for the disaggregation issues: filled in as they land.
    transport: str = "tcp"  # tcp | verbs
    host: str = "127.0.0.1"
    port: int = 0
    nics: tuple[str, ...] = ("auto",)
    num_streams: int = 2
    spin_us: int = 50


@dataclass(frozen=True)
class Config:
    role: str = "colocated"
    model: ModelConfig = field(default_factory=ModelConfig)
    kv_cache: KVCacheConfig = field(default_factory=KVCacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    server: ServerConfig = field(default_factory=ServerConfig)
    messenger: MessengerConfig = field(default_factory=MessengerConfig)
    source: str = "<defaults>"  # the file this config came from, for error messages
