"""Role configs: YAML in, frozen dataclasses out.

The dataclasses below are the contract between the config loader, the engine and the server.
The engine is built from ``ModelConfig``, ``KVCacheConfig`` and ``SchedulerConfig``; the server
reads ``ServerConfig``; the messenger reads ``MessengerConfig``.

NOTE: YAML is only an input format. Derived values are properties, never stored twice.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

ROLES = ("colocated", "prefill", "decode")
TRANSPORTS = ("tcp", "verbs")
ATTENTION_BACKENDS = ("torch", "flashinfer")
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
    prefix_caching: bool = True  # reuse cached full pages of earlier requests (pdkv/kv/prefix_cache.py)


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
    node_id: int = 0  # 0: a random id per process (each node of a cluster needs a distinct one)
    # Disaggregation (roles prefill / decode).
    control_host: str = "127.0.0.1"  # prefill: where the control listener binds
    control_port: int = 0  # prefill: control listener port (decode nodes dial it); 0: any free port
    prefill_peers: tuple[str, ...] = ()  # decode: "host:port" of each prefill node's control listener
    layerwise: bool = True  # stream each layer's pages as it finishes; false: after the forward pass
    transfer_timeout_s: float = 30.0  # decode: PREFILL sent -> KV landed, else the request fails
    heartbeat_s: float = 1.0  # control channel heartbeat interval
    lease_s: float = 5.0  # a peer silent this long is dead: its requests fail, their pages return
    connect_timeout_s: float = 30.0  # decode: how long to keep dialing a prefill peer at start-up


@dataclass(frozen=True)
class ParallelConfig:
    # Tensor parallelism on one node: rank 0 runs the engine (scheduler, server, messenger) and
    # starts ranks 1..tp-1 as processes that follow its steps. CPU: gloo, KV in shared memory;
    # GPU: NCCL, rank r on cuda:(N + r) for model.device cuda:N, KV in cuMem shared with rank 0.
    tp: int = 1
    timeout_s: float = 120.0  # a collective (all-reduce) that waits longer fails the step
    startup_timeout_s: float = 600.0  # ranks must start and load their weights within this


@dataclass(frozen=True)
class Config:
    role: str = "colocated"
    model: ModelConfig = field(default_factory=ModelConfig)
    kv_cache: KVCacheConfig = field(default_factory=KVCacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    server: ServerConfig = field(default_factory=ServerConfig)
    messenger: MessengerConfig = field(default_factory=MessengerConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    source: str = "<defaults>"  # the file this config came from, for error messages


class ConfigError(ValueError):
    """A config that cannot be used. The message names the file (or --set), the field and what
    was expected: ``configs/x.yaml: kv_cache.layout must be one of HND, NHD, got 'HDN'``."""


# Fields that a YAML file may not set: bookkeeping, not configuration.
_INTERNAL = {"source"}


def load_config(path: str | Path | None = None, overrides: Iterable[str] = (), *,
                check_paths: bool = True) -> Config:
    """Read a YAML role config, apply ``--set key=value`` overrides, validate, freeze.

    ``path=None`` starts from the defaults. Overrides use dotted keys that mirror the YAML
    (``server.port=8001``); their values are parsed as YAML scalars (``null``, ``8001``,
    ``[a, b]``) except where the field is a string, which takes the text as written.
    ``check_paths=False`` skips checking that ``model.path`` exists (for configs of other hosts).
    """
    source = str(path) if path is not None else "<defaults>"
    data: dict[str, Any] = {}
    if path is not None:
        data = _read_yaml(Path(path))
    origins: dict[str, str] = {}  # dotted field -> the --set that gave its value, for errors
    for item in overrides:
        origins[_apply_override(data, item)] = f"--set {item}"
    cfg = _build(Config, data, source, prefix="")
    cfg = dataclasses.replace(cfg, source=source)
    if cfg.model.path.startswith("~"):  # shells leave "--set model.path=~/x" unexpanded
        cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, path=str(Path(cfg.model.path).expanduser())))
    validate(cfg, origins, check_paths=check_paths)
    return cfg


def config_from_dict(data: dict[str, Any], source: str = "<dict>") -> Config:
    """Build and validate a Config from a plain nested dict (same schema as the YAML)."""
    cfg = dataclasses.replace(_build(Config, data, source, prefix=""), source=source)
    validate(cfg)
    return cfg


def config_to_dict(cfg: Config) -> dict[str, Any]:
    """The nested dict a YAML file would hold for ``cfg`` (tuples as lists, no bookkeeping)."""
    out = dataclasses.asdict(cfg)
    for name in _INTERNAL:
        out.pop(name, None)
    return _lists(out)


def _lists(x: Any) -> Any:
    if isinstance(x, dict):
        return {k: _lists(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_lists(v) for v in x]
    return x


def _read_yaml(path: Path) -> dict[str, Any]:
    import yaml  # only the loader needs it; the dataclasses are importable without

    try:
        text = path.read_text()
    except OSError as e:
        raise ConfigError(f"{path}: cannot read config file: {e.strerror or e}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(e, "problem", None) or str(e)
        raise ConfigError(f"{path}: not valid YAML{where}: {problem}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of sections, got {type(data).__name__}")
    return data


def _apply_override(data: dict[str, Any], item: str) -> str:
    """Set one ``key=value`` in the nested dict; returns the dotted key."""
    where = f"--set {item}"
    key, eq, raw = item.partition("=")
    key = key.strip()
    if not eq or not key:
        raise ConfigError(f"{where}: expected KEY=VALUE with a dotted key such as server.port=8001")
    parts = key.split(".")
    hint = _field_type(Config, parts, where)
    node = data
    for i, part in enumerate(parts[:-1]):
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"{where}: {'.'.join(parts[:i + 1])} is not a section")
        node = child
    if isinstance(hint, type) and dataclasses.is_dataclass(hint):
        raise ConfigError(f"{where}: {key} is a section; set one of its fields "
                          f"({', '.join(key + '.' + n for n in _hints(hint))})")
    node[parts[-1]] = _coerce(_parse_value(raw, hint), hint, where, key)
    return key


def _field_type(cls: type, parts: list[str], where: str) -> Any:
    """The type hint of the field at dotted ``parts``; unknown names are an error."""
    hint: Any = cls
    for i, part in enumerate(parts):
        if not (isinstance(hint, type) and dataclasses.is_dataclass(hint)):
            raise ConfigError(f"{where}: {'.'.join(parts[:i])} is a value, not a section")
        hints = _hints(hint)
        if part not in hints:
            raise ConfigError(f"{where}: unknown field {'.'.join(parts[:i + 1])!r} "
                              f"(known: {', '.join(hints)})")
        hint = hints[part]
    return hint


def _parse_value(raw: str, hint: Any) -> Any:
    import yaml

    text = raw.strip()
    allowed = _union_args(hint)
    if str in allowed and not (type(None) in allowed and text in ("null", "~", "")):
        return raw  # a string field takes the text as written ("--set server.api_key=123")
    try:
        return yaml.safe_load(text) if text else None
    except yaml.YAMLError:
        return raw


def _hints(cls: type) -> dict[str, Any]:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls) if f.name not in _INTERNAL}


def _union_args(hint: Any) -> tuple[Any, ...]:
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return typing.get_args(hint)
    return (hint,)


def _build(cls: type, data: Any, source: str, prefix: str) -> Any:
    """Turn a nested dict into dataclass ``cls``, checking names and types field by field."""
    where = prefix.rstrip(".") or "the top level"
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: {where} must be a mapping, got {_show(data)}")
    hints = _hints(cls)
    unknown = [k for k in data if k not in hints]
    if unknown:
        raise ConfigError(f"{source}: unknown field {prefix}{unknown[0]} (known in {where}: {', '.join(hints)})")
    kwargs = {}
    for name, value in data.items():
        hint = hints[name]
        if isinstance(hint, type) and dataclasses.is_dataclass(hint):
            kwargs[name] = _build(hint, {} if value is None else value, source, f"{prefix}{name}.")
        else:
            kwargs[name] = _coerce(value, hint, source, f"{prefix}{name}")
    return cls(**kwargs)


def _coerce(value: Any, hint: Any, source: str, name: str) -> Any:
    allowed = _union_args(hint)
    if value is None:
        if type(None) in allowed:
            return None
        raise ConfigError(f"{source}: {name} must be {_describe(hint)}, got null")
    for t in allowed:
        if t is bool and isinstance(value, bool):
            return value
        if t is int and isinstance(value, int) and not isinstance(value, bool):
            return value
        if t is float and isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if t is str and isinstance(value, str):
            return value
        if typing.get_origin(t) is tuple:
            items = [value] if isinstance(value, str) else value
            if isinstance(items, (list, tuple)) and all(isinstance(v, str) for v in items):
                return tuple(items)
    raise ConfigError(f"{source}: {name} must be {_describe(hint)}, got {_show(value)}")


def _describe(hint: Any) -> str:
    names = {int: "an integer", float: "a number", str: "a string", bool: "true or false",
             type(None): "null"}
    parts = [names.get(t, "a list of strings" if typing.get_origin(t) is tuple else str(t))
             for t in _union_args(hint)]
    return " or ".join(parts)


def _show(value: Any) -> str:
    return f"{value!r} ({type(value).__name__})" if not isinstance(value, str) else repr(value)


def validate(cfg: Config, origins: dict[str, str] | None = None, *, check_paths: bool = True) -> None:
    """Check values (not just types); raise ConfigError naming the file (or the ``--set`` that
    gave the value, from ``origins``) and the field."""
    origins = origins or {}

    def need(ok: bool, name: str, expected: str, got: Any) -> None:
        if not ok:
            raise ConfigError(f"{origins.get(name, cfg.source)}: {name} must be {expected}, got {got!r}")

    def one_of(name: str, value: Any, choices: tuple[str, ...]) -> None:
        need(value in choices, name, f"one of {', '.join(choices)}", value)

    m, kv, s, sv, ms = cfg.model, cfg.kv_cache, cfg.scheduler, cfg.server, cfg.messenger
    pc = cfg.parallel
    need(pc.tp >= 1, "parallel.tp", "a positive integer (tensor-parallel ranks)", pc.tp)
    need(pc.timeout_s > 0, "parallel.timeout_s", "a positive number of seconds", pc.timeout_s)
    need(pc.startup_timeout_s > 0, "parallel.startup_timeout_s", "a positive number of seconds",
         pc.startup_timeout_s)
    one_of("role", cfg.role, ROLES)
    one_of("model.dtype", m.dtype, DTYPES)
    one_of("model.attention_backend", m.attention_backend, ATTENTION_BACKENDS)
    need(m.device == "cpu" or m.device == "cuda" or (m.device.startswith("cuda:") and m.device[5:].isdigit()),
         "model.device", "cpu, cuda or cuda:N", m.device)
    need(m.max_model_len is None or m.max_model_len > 0, "model.max_model_len", "a positive integer or null",
         m.max_model_len)
    need(m.served_name is None or m.served_name.strip() != "", "model.served_name", "a non-empty name or null",
         m.served_name)
    if m.path and check_paths:
        need(Path(m.path).is_dir(), "model.path",
             "a local Hugging Face model folder (config.json, *.safetensors, tokenizer.json) that exists", m.path)
    need(kv.page_size > 0 and kv.page_size & (kv.page_size - 1) == 0, "kv_cache.page_size", "a power of two",
         kv.page_size)
    need(kv.num_pages is None or kv.num_pages > 0, "kv_cache.num_pages", "a positive integer or null", kv.num_pages)
    need(0.0 < kv.memory_fraction <= 1.0, "kv_cache.memory_fraction", "in (0, 1]", kv.memory_fraction)
    need(kv.memory_gib > 0, "kv_cache.memory_gib", "positive", kv.memory_gib)
    one_of("kv_cache.layout", kv.layout, LAYOUTS)
    need(s.max_num_batched_tokens > 0, "scheduler.max_num_batched_tokens", "a positive integer",
         s.max_num_batched_tokens)
    need(0 < s.chunk_size <= s.max_num_batched_tokens, "scheduler.chunk_size",
         f"positive and at most scheduler.max_num_batched_tokens ({s.max_num_batched_tokens})", s.chunk_size)
    need(s.max_num_seqs > 0, "scheduler.max_num_seqs", "a positive integer", s.max_num_seqs)
    need(sv.host.strip() != "", "server.host", "a host name or address", sv.host)
    need(0 <= sv.port <= 65535, "server.port", "a TCP port in 0..65535 (0: any free port)", sv.port)
    need(sv.api_key is None or sv.api_key.strip() != "", "server.api_key", "a non-empty key or null", sv.api_key)
    need(sv.max_body_bytes >= 1024, "server.max_body_bytes", "at least 1024", sv.max_body_bytes)
    one_of("messenger.transport", ms.transport, TRANSPORTS)
    need(0 <= ms.port <= 65535, "messenger.port", "a TCP port in 0..65535", ms.port)
    need(ms.num_streams > 0, "messenger.num_streams", "a positive integer", ms.num_streams)
    need(ms.spin_us >= 0, "messenger.spin_us", "zero or positive", ms.spin_us)
    need(0 <= ms.node_id < 2**63, "messenger.node_id", "an integer in [0, 2**63) (0: random)", ms.node_id)
    need(0 <= ms.control_port <= 65535, "messenger.control_port", "a TCP port in 0..65535", ms.control_port)
    for name in ("transfer_timeout_s", "heartbeat_s", "lease_s", "connect_timeout_s"):
        need(getattr(ms, name) > 0, f"messenger.{name}", "a positive number of seconds", getattr(ms, name))
    need(ms.lease_s > ms.heartbeat_s, "messenger.lease_s",
         f"longer than messenger.heartbeat_s ({ms.heartbeat_s})", ms.lease_s)
    for peer in ms.prefill_peers:
        host, _, port = peer.rpartition(":")
        need(bool(host) and port.isdigit() and 0 < int(port) <= 65535, "messenger.prefill_peers",
             "a list of host:port (each prefill node's messenger.control_port)", peer)
    if cfg.role in ("prefill", "decode"):
        # NOTE: the transports read and write KV pages as host memory; GPU KV caches need GPUDirect
        # RDMA registration (cuMem export to the NIC), which the disaggregated roles do not do yet.
        need(m.device == "cpu", "model.device", f"cpu for role {cfg.role} (disaggregated serving moves KV "
             f"pages from host memory; GPU KV caches are not supported by the messenger yet)", m.device)
    if cfg.role == "decode":
        need(bool(ms.prefill_peers), "messenger.prefill_peers",
             "at least one host:port for role decode (the prefill nodes to use)", list(ms.prefill_peers))
