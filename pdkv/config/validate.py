"""Checking a Config's values (not just their types): each rule names the field and where its
value came from (the file, or the ``--set`` that gave it)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pdkv.config.sections import (ATTENTION_BACKENDS, DTYPES, LAYOUTS, MAX_SPEC_TOKENS, ROLES, SPEC_METHODS, TRANSPORTS,
                                  Config, ConfigError)

# Speculative methods per role. A decode node drafts (ngram needs nothing from its prefill node);
# a prefill node never samples, so it takes only methods whose proposer needs prefill-side work.
# (mtp / draft: the prefill node also runs the MTP layer / prefills the draft model over the
# prompt and streams their KV, pdkv/disagg/spec_handoff.py)
ROLE_SPEC_METHODS = {"colocated": SPEC_METHODS, "decode": SPEC_METHODS, "prefill": ("draft", "mtp")}
_ROLE_SPEC_WHY = {"colocated": "", "decode": "",
                  "prefill": "the prefill node never samples; ngram needs nothing from it"}


def _cpus_ok(text: str) -> bool:
    from pdkv.cpus import parse_cpu_list

    try:
        parse_cpu_list(text)
    except ValueError:
        return False
    return True


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
    need(_cpus_ok(pc.cpus), "parallel.cpus", "a CPU list like 0 or 0-3,8 (empty: every CPU)", pc.cpus)
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
    for name in ("idle_timeout_s", "keepalive_timeout_s"):
        need(getattr(sv, name) > 0, f"server.{name}", "a positive number of seconds", getattr(sv, name))
    need(sv.max_connections > 0, "server.max_connections", "a positive integer", sv.max_connections)
    need(sv.max_waiting_requests > 0, "server.max_waiting_requests", "a positive integer", sv.max_waiting_requests)
    need(sv.max_prompts_x_n > 0, "server.max_prompts_x_n", "a positive integer", sv.max_prompts_x_n)
    need(ms.handshake_timeout_s > 0, "messenger.handshake_timeout_s", "a positive number of seconds",
         ms.handshake_timeout_s)
    need(4096 <= ms.max_frame_bytes <= (1 << 30), "messenger.max_frame_bytes", "4096..2**30 bytes", ms.max_frame_bytes)
    for name in ("max_control_conns", "max_control_per_source", "max_setups"):
        need(getattr(ms, name) > 0, f"messenger.{name}", "a positive integer", getattr(ms, name))
    need(ms.lease_s > ms.heartbeat_s, "messenger.lease_s",
         f"longer than messenger.heartbeat_s ({ms.heartbeat_s})", ms.lease_s)
    for peer in ms.prefill_peers:
        host, _, port = peer.rpartition(":")
        need(bool(host) and port.isdigit() and 0 < int(port) <= 65535, "messenger.prefill_peers",
             "a list of host:port (each prefill node's messenger.control_port)", peer)
    sp = cfg.speculative
    if sp.method is not None:
        one_of("speculative.method", sp.method, SPEC_METHODS)
        need(1 <= sp.num_tokens <= MAX_SPEC_TOKENS, "speculative.num_tokens",
             f"an integer in [1, {MAX_SPEC_TOKENS}]", sp.num_tokens)
        need(1 <= sp.ngram_min <= sp.ngram_max, "speculative.ngram_min",
             f"in [1, speculative.ngram_max ({sp.ngram_max})]", sp.ngram_min)
        if sp.method == "draft":
            need(bool(sp.draft_model.path), "speculative.draft_model.path",
                 "a local Hugging Face model folder for method draft", sp.draft_model.path)
        need(sp.draft_model.num_pages is None or sp.draft_model.num_pages > 0, "speculative.draft_model.num_pages",
             "a positive integer or null", sp.draft_model.num_pages)
        if sp.draft_model.path and check_paths:
            need(Path(sp.draft_model.path).is_dir(), "speculative.draft_model.path",
                 "a local Hugging Face model folder that exists", sp.draft_model.path)
        allowed = ROLE_SPEC_METHODS.get(cfg.role, ())
        need(sp.method in allowed, "speculative.method",
             f"one of {', '.join(allowed)} or null for role {cfg.role} ({_ROLE_SPEC_WHY[cfg.role]})" if allowed
             else f"null for role {cfg.role} ({_ROLE_SPEC_WHY.get(cfg.role, '')})", sp.method)
    if cfg.role in ("prefill", "decode"):
        # NOTE: the transports read and write KV pages as host memory; GPU KV caches need GPUDirect
        # RDMA registration (cuMem export to the NIC), which the disaggregated roles do not do yet.
        need(m.device == "cpu", "model.device", f"cpu for role {cfg.role} (disaggregated serving moves KV "
             f"pages from host memory; GPU KV caches are not supported by the messenger yet)", m.device)
    if cfg.role == "decode":
        need(bool(ms.prefill_peers), "messenger.prefill_peers",
             "at least one host:port for role decode (the prefill nodes to use)", list(ms.prefill_peers))
