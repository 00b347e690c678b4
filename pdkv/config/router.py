"""The router's config (``pdkv router -c configs/router.yaml``): a file of its own, not a role.

    host: 127.0.0.1
    port: 8080
    nodes: [http://127.0.0.1:8001, http://127.0.0.1:8002]   # decode or colocated nodes' APIs
    policy: cache_aware        # cache_aware | least_load | round_robin

A router holds no model and no engine, so it shares none of a role config's sections; it
reuses the loader's typed field coercion so its errors read the same (file, field, expected).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable
from urllib.parse import urlsplit

from pdkv.config.loader import _build, _coerce, _hints, _parse_value, _read_yaml
from pdkv.config.sections import DISCOVERY, ClusterConfig, ConfigError

POLICIES = ("cache_aware", "least_load", "round_robin")


@dataclass(frozen=True)
class RouterConfig:
    host: str = "127.0.0.1"
    port: int = 8080
    nodes: tuple[str, ...] = ()  # base URLs of the nodes' OpenAI APIs (decode or colocated)
    policy: str = "cache_aware"
    # Health and load: every node's GET /load is polled this often. A poll that is refused,
    # reset or answered non-200 takes the node out at once (a dead process: out within
    # poll_interval_s); polls that time out take it out once no poll has succeeded for
    # down_after_s (a hung node; one slow poll on a busy host is not a death). The next good
    # poll takes it back.
    poll_interval_s: float = 0.2
    poll_timeout_s: float = 0.5
    down_after_s: float = 1.0
    # Prefix affinity: the first affinity_prefix_chars characters of the prompt (the chat
    # messages' text, in order) pick a node on a consistent-hash ring, so a conversation's
    # turns land where their KV already is; the affine node is kept while its load is at most
    # the mean load over healthy nodes plus balance_abs requests, else the least loaded is used.
    affinity_prefix_chars: int = 256
    balance_abs: float = 4.0
    virtual_nodes: int = 64  # points per node on the ring: smooth shares, few keys move on a change
    request_timeout_s: float = 600.0  # one proxied request, end to end
    max_body_bytes: int = 1 << 20
    # Fleet discovery (pdkv/fleet, docs/FLEET.md): cluster.discovery etcd: the decode and
    # colocated nodes registered under cluster.name join and leave as their leases do (nodes: the
    # ones known before etcd answers, may be empty).
    cluster: ClusterConfig = dataclasses.field(default_factory=ClusterConfig)
    # Request migration (pdkv/router/migrate.py): a stream whose node dies mid-generation goes on
    # on another node (prompt + the tokens already streamed); at most migration_limit moves per
    # request, and only while it has streamed at most migration_max_tokens tokens (the router
    # holds them). 0: off (the client gets an SSE error naming the node, as without it).
    migration_limit: int = 3
    migration_max_tokens: int = 4096
    source: str = "<defaults>"


def load_router_config(path: str | Path | None = None, overrides: Iterable[str] = ()) -> RouterConfig:
    """Read a router YAML, apply ``--set key=value`` overrides, validate, freeze."""
    source = str(path) if path is not None else "<defaults>"
    data: dict[str, Any] = _read_yaml(Path(path)) if path is not None else {}
    data.pop("source", None)
    hints = _hints(RouterConfig)
    hints.pop("source", None)
    for item in overrides:
        key, eq, raw = item.partition("=")
        key = key.strip()
        if not eq or key not in hints:
            raise ConfigError(f"--set {item}: expected KEY=VALUE with KEY one of {', '.join(hints)}")
        data[key] = _coerce(_parse_value(raw, hints[key]), hints[key], f"--set {item}", key)
    cfg = dataclasses.replace(_build(RouterConfig, data, source, prefix=""), source=source)
    _validate(cfg)
    return cfg


def _validate(cfg: RouterConfig) -> None:
    def bad(field: str, what: str) -> ConfigError:
        return ConfigError(f"{cfg.source}: {field} {what}")

    if cfg.cluster.discovery not in DISCOVERY:
        raise bad("cluster.discovery", f"must be one of {', '.join(DISCOVERY)}, got {cfg.cluster.discovery!r}")
    if cfg.cluster.discovery == "etcd" and not cfg.cluster.etcd.endpoints:
        raise bad("cluster.etcd.endpoints", "must list at least one http(s)://host:port with discovery etcd")
    if not cfg.nodes and cfg.cluster.discovery == "static":
        raise bad("nodes", "must list at least one node URL, e.g. [http://127.0.0.1:8001] "
                           "(or cluster.discovery: etcd)")
    if cfg.migration_limit < 0 or cfg.migration_max_tokens < 0:
        raise bad("migration_limit/migration_max_tokens", "must be >= 0 (migration_limit 0: off)")
    for url in cfg.nodes:
        u = urlsplit(url)
        if u.scheme not in ("http",) or not u.hostname or u.port is None or u.path not in ("", "/"):
            raise bad("nodes", f"entries must be http://HOST:PORT (a node's API root), got {url!r}")
    if len(set(n.rstrip("/") for n in cfg.nodes)) != len(cfg.nodes):
        raise bad("nodes", "lists a node twice")
    if cfg.policy not in POLICIES:
        raise bad("policy", f"must be one of {', '.join(POLICIES)}, got {cfg.policy!r}")
    if not 0 <= cfg.port <= 65535:
        raise bad("port", f"must be 0..65535, got {cfg.port}")
    for name in ("poll_interval_s", "poll_timeout_s", "down_after_s", "request_timeout_s"):
        if getattr(cfg, name) <= 0:
            raise bad(name, f"must be > 0, got {getattr(cfg, name)}")
    if cfg.affinity_prefix_chars < 1 or cfg.virtual_nodes < 1 or cfg.max_body_bytes < 1:
        raise bad("affinity_prefix_chars/virtual_nodes/max_body_bytes", "must be >= 1")
    if cfg.balance_abs < 0:
        raise bad("balance_abs", f"must be >= 0, got {cfg.balance_abs}")
