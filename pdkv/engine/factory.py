"""Wiring an engine: model load, tensor-parallel ranks, KV memory, allocator, attention backend,
runner and scheduler. ``build_parts`` is what ``LLMEngine.__init__`` calls (and
``pdkv.engine.build_engine(cfg)`` through it), so the engine class itself holds no wiring. The
KV connector is not made here: a disaggregated node makes it once its messenger is open and
installs it with ``LLMEngine.set_connector``.

Order matters and is why this is one function: the backend is checked before the weights load
(fail fast); TP ranks start before rank 0 loads (they load their slices meanwhile); the KV cache
is sized after the load (the model's shapes and the memory left) and only then made.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from pdkv.config import KVCacheConfig, ModelConfig, SchedulerConfig
from pdkv.engine.runner import ModelRunner
from pdkv.engine.sampler import Sampler
from pdkv.engine.scheduler import Scheduler
from pdkv.kv import KVCache, PageAllocator
from pdkv.kv.prefix_cache import PrefixCache, cache_salt

log = logging.getLogger(__name__)


@dataclass
class EngineParts:
    """Everything LLMEngine runs on, wired."""

    model_config: ModelConfig
    kv_config: KVCacheConfig
    scheduler_config: SchedulerConfig
    loaded: object  # models.loader.LoadedModel
    tokenizer: object  # pdkv.tokenizer.Tokenizer
    model_name: str
    max_model_len: int
    kv: KVCache
    allocator: PageAllocator
    runner: ModelRunner
    scheduler: Scheduler
    tp: object  # pdkv.tp.TPLeader with parallel.tp > 1, else None


def num_pages_for(cfg: KVCacheConfig, page_bytes_all_layers: int, device: torch.device, max_useful: int) -> int:
    """cfg.num_pages if set; else what the memory budget holds, capped at ``max_useful`` (every
    running request at full context: more pages could never be used, only zeroed)."""
    if cfg.num_pages is not None:
        if cfg.num_pages < 1:
            raise ValueError(f"kv_cache.num_pages must be >= 1, got {cfg.num_pages}")
        return cfg.num_pages
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        budget = int(free * cfg.memory_fraction)
    else:
        budget = int(cfg.memory_gib * (1 << 30))
    return max(1, min(budget // page_bytes_all_layers, max_useful))


def _num_threads(requested: int | None, tp: int) -> int:
    # Cores this process may run on (a container's CPU set), not the host's count.
    n = requested or (len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1)
    return max(1, n // tp) if tp > 1 else n  # the ranks share this host's cores


def _fingerprint(loaded) -> str:
    """What identifies the weights for the prefix cache's salt: config.json and the weight
    files' names and sizes (cheap, and equal on every node serving the same checkpoint)."""
    import hashlib  # noqa: PLC0415
    import json  # noqa: PLC0415

    from pdkv.models.loader import weight_files  # noqa: PLC0415

    h = hashlib.blake2b(json.dumps(loaded.hf_config, sort_keys=True, default=str).encode(), digest_size=16)
    try:
        for f in weight_files(Path(loaded.path)):
            h.update(f"{f.name}:{f.stat().st_size};".encode())
    except Exception:  # noqa: BLE001 - a model built in memory (tests) has no files: config only
        pass
    return h.hexdigest()


def kv_cache_dtype(cfg: KVCacheConfig, loaded) -> tuple[torch.dtype, list[tuple[float, float]]]:
    """The cache's element type (kv_cache.dtype) and its per-layer (K, V) scales: for fp8_e4m3
    kv_cache.fp8_scale, else the checkpoint's k_scale / v_scale, else 1.0 (models/attention/fp8_kv.py)."""
    n = loaded.arch.num_layers
    if cfg.dtype == "auto":
        return loaded.dtype, [(1.0, 1.0)] * n
    if cfg.dtype != "fp8_e4m3":
        raise ValueError(f"kv_cache.dtype must be auto or fp8_e4m3, got {cfg.dtype!r}")
    fp8 = getattr(torch, "float8_e4m3fn", None)
    if fp8 is None:
        raise ValueError(f"kv_cache.dtype fp8_e4m3 needs torch.float8_e4m3fn, which torch {torch.__version__} lacks")
    if cfg.fp8_scale is not None:
        return fp8, [(float(cfg.fp8_scale), float(cfg.fp8_scale))] * n
    found = loaded.kv_scales or {}
    return fp8, [found.get(i, (1.0, 1.0)) for i in range(n)]


def _salt_dtype(model_dtype: torch.dtype, kv_dtype: torch.dtype) -> str:
    """The prefix cache's dtype key: pages of an FP8 cache never match a bf16 one's."""
    return str(model_dtype) if kv_dtype == model_dtype else f"{model_dtype}+kv:{kv_dtype}"


def build_parts(model: ModelConfig, kv_cache: KVCacheConfig, scheduler: SchedulerConfig,
                progress: Callable[[int, int], None] | None = None, kv_buffer=None,
                num_threads: int | None = None, parallel=None, ep=None) -> EngineParts:
    """``kv_buffer``: memory for the KV cache (see pdkv.kv.KVCache), e.g. one the messenger
    registered, or a callable ``f(nbytes) -> buffer`` that makes it once the size is known;
    ``num_threads``: torch threads on the CPU (default: one per core); ``parallel``: a
    pdkv.config.ParallelConfig (None: one rank); ``ep``: this process's pdkv.dp.ExpertGroup when
    it is one rank of a data-parallel group with expert parallelism (pdkv/dp/rank.py)."""
    from pdkv.models import load_model  # noqa: PLC0415 - keeps `import pdkv.engine` light
    from pdkv.models.attention import get_backend  # noqa: PLC0415
    from pdkv.models.loader import read_json, resolve_dtype  # noqa: PLC0415
    from pdkv.tokenizer import Tokenizer  # noqa: PLC0415

    path = model.path
    if not path:
        from pdkv.default_model import ensure_default_model  # noqa: PLC0415

        path = str(ensure_default_model())
    device = torch.device(model.device)
    tp_degree = parallel.tp if parallel is not None else 1
    num_threads = _num_threads(num_threads, tp_degree)
    if device.type == "cpu":
        torch.set_num_threads(num_threads)
    hf = read_json(Path(path) / "config.json") if Path(path).is_dir() else {}
    # Fail fast, before the weights load: unknown backend, or one that cannot run here.
    get_backend(model.attention_backend).check_available(device, resolve_dtype(model.dtype, hf))
    max_pos = int(hf.get("max_position_embeddings") or 2048)
    if model.max_model_len is not None and not 1 <= model.max_model_len <= max_pos:
        raise ValueError(f"model.max_model_len must be in [1, {max_pos}] (the model's "
                         f"max_position_embeddings), got {model.max_model_len}")
    # With tp > 1, ranks 1.. start now and load their slices while we load ours (pdkv/tp).
    tp = None
    if tp_degree > 1:
        if kv_buffer is not None:
            raise ValueError("kv_buffer cannot be combined with parallel.tp > 1: the KV memory of "
                             "every rank is made by pdkv.tp (register engine.tp.regions instead)")
        from pdkv.tp import TPLeader  # noqa: PLC0415

        tp = TPLeader(path, model.dtype, model.device, tp_degree, model.max_model_len or max_pos,
                      num_threads, parallel.timeout_s, parallel.startup_timeout_s, cpu_kernels=model.cpu_kernels,
                      expert_parallel=parallel.expert_parallel, lanes=ep.lane_init() if ep is not None else None)
        if ep is not None:  # tp x dp: the DP rank's forwards, dummies too, are announced to its lanes
            ep.lead(tp)
    # "on" shares GPU weights too (CUDA IPC, pdkv/gpu/weights_ipc.py); "auto" host memory only
    share = model.share_weights == "on" or (model.share_weights == "auto" and torch.device(device).type == "cpu")
    if share and tp is None and ep is None:
        from pdkv.shared_weights import load_shared  # noqa: PLC0415

        loaded, shared = load_shared(path, model.dtype, str(device), model.max_model_len or max_pos, progress,
                                     model.cpu_kernels, _fingerprint)
        loaded.shared = shared  # the owner's server / the attached mapping: lives with the model
    else:
        loaded = load_model(path, model.dtype, str(device), model.max_model_len or max_pos, progress,
                            tp=tp.parallel if tp is not None else None, cpu_kernels=model.cpu_kernels, ep=ep)
    arch = loaded.arch
    max_model_len = model.max_model_len or arch.max_position_embeddings

    from pdkv.models.kv_layout import kv_layout  # noqa: PLC0415 - K/V heads or an MLA latent, per arch

    layout = kv_layout(arch)
    kv_dtype, kv_scales = kv_cache_dtype(kv_cache, loaded)
    page_bytes = layout.page_bytes(kv_cache.page_size, kv_dtype) * arch.num_layers
    pages_per_seq = -(-max_model_len // kv_cache.page_size)
    num_pages = num_pages_for(kv_cache, page_bytes, device, scheduler.max_num_seqs * pages_per_seq)
    if callable(kv_buffer):  # a factory: memory of exactly the cache's size (the messenger registers it)
        kv_buffer = kv_buffer(page_bytes * num_pages)
    if tp is not None:  # every rank's cache, all mapped here too (engine.tp.regions)
        tp.wait_loaded()
        kv_buffer = tp.setup_kv(arch, loaded.full_arch, kv_dtype, num_pages, kv_cache.page_size,
                                kv_cache.layout, model.attention_backend, kv_scales)
    kv = layout.make_cache(arch.num_layers, num_pages, kv_cache.page_size, kv_dtype, kv_cache.layout, device,
                           buffer=kv_buffer)
    kv.kv_scales = kv_scales
    allocator = PageAllocator(num_pages)
    cache = None
    if kv_cache.prefix_caching:
        cache = PrefixCache(allocator, kv_cache.page_size,
                            cache_salt(_fingerprint(loaded), _salt_dtype(loaded.dtype, kv_dtype),
                                       kv_cache.page_size))
    backend = layout.make_backend(model.attention_backend, kv)
    if getattr(backend, "fp8", False):
        backend.q_dtype = loaded.dtype  # FlashInfer over an FP8 cache: the queries' dtype
    backend.use_cpu_kernel &= model.cpu_kernels
    if device.type == "cpu":
        from pdkv.models import cpu_kernels  # noqa: PLC0415

        log.info("CPU kernels: %s (GEMM path %s, up to %d rows; more: %s)",
                 "on" if model.cpu_kernels and cpu_kernels.AVAILABLE else "off",
                 cpu_kernels.GEMM_PATH, cpu_kernels.KERNEL_ROWS, "oneDNN" if cpu_kernels.ONEDNN else "MKL")
        want = os.environ.get("PDKV_GEMM_PATH")
        if want and cpu_kernels.AVAILABLE and want != cpu_kernels.GEMM_PATH:
            log.warning("PDKV_GEMM_PATH=%r is not a GEMM path this CPU runs (avx512, avx2, pairs): "
                        "using %s", want, cpu_kernels.GEMM_PATH)
        if model.cpu_kernels and model.gemm_choice == "measure" and loaded.dtype is torch.float32:
            from pdkv.models.gemm_tuner import tune  # noqa: PLC0415

            tune(loaded.model, num_threads)
    tokenizer = Tokenizer(path, arch.eos_token_id)
    runner = ModelRunner(loaded.model, backend, device, Sampler(model.seed, tokenizer.eos_token_ids), num_threads,
                         followers=ep if ep is not None else tp)
    if model.cuda_graphs:  # after the KV cache: the padding rows write into one of its pages
        from pdkv.engine.cuda_graphs import build_decode_graphs  # noqa: PLC0415

        runner.graphs = build_decode_graphs(loaded.model, backend, allocator, max_model_len,
                                            model.cuda_graph_batch_sizes, device)
    sched = Scheduler(allocator, kv_cache.page_size, scheduler.max_num_batched_tokens, scheduler.chunk_size,
                      scheduler.max_num_seqs, prefix_cache=cache, policy=scheduler.policy)
    return EngineParts(model, kv_cache, scheduler, loaded, tokenizer,
                       model.served_name or loaded.path.resolve().name, max_model_len, kv, allocator,
                       runner, sched, tp)

