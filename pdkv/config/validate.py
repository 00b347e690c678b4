"""Checking a Config's values (not just their types): each rule names the field and where its
value came from (the file, or the ``--set`` that gave it)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pdkv.config.sections import (ATTENTION_BACKENDS, DTYPES, KV_DTYPES, LAYOUTS, LIBFABRIC_PROVIDERS,
                                  ADMISSION, DISCOVERY, MAX_AFFINITY_PAGES, MAX_CUDA_GRAPH_BATCH, MAX_SPEC_TOKENS,
                                  ROLES, SCHEDULING_POLICIES, SPEC_METHODS, STAGING_MODES, TRANSPORTS, Config,
                                  ConfigError)
from pdkv.transports import Capability, capabilities, names_with

# Speculative methods per role. A decode node drafts (ngram needs nothing from its prefill node);
# a prefill node never samples, so it takes only methods whose proposer needs prefill-side work.
# (mtp / draft: the prefill node also runs the MTP layer / prefills the draft model over the
# prompt and streams their KV, pdkv/disagg/spec_handoff.py)
ROLE_SPEC_METHODS = {"colocated": SPEC_METHODS, "decode": SPEC_METHODS, "prefill": ("draft", "mtp")}
KV_HANDOFFS = ("auto", "copy", "share")  # disagg.kv_handoff (pdkv/disagg/kv_share.py)
HANDOFF_METHODS = ("draft", "mtp")  # the prefill node computes the proposer's KV (pdkv/disagg/spec_handoff.py)
_ROLE_SPEC_WHY = {"colocated": "", "decode": "",
                  "prefill": "the prefill node never samples; ngram needs nothing from it"}


def _is_this_host(host: str) -> bool:
    """A loopback name or address (a same-host transport's peers); no name resolution here."""
    import ipaddress  # noqa: PLC0415

    host = host.strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False

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
    _check_dp(cfg, need)
    one_of("role", cfg.role, ROLES)
    one_of("model.dtype", m.dtype, DTYPES)
    one_of("model.attention_backend", m.attention_backend, ATTENTION_BACKENDS)
    need(m.device == "cpu" or m.device == "cuda" or (m.device.startswith("cuda:") and m.device[5:].isdigit()),
         "model.device", "cpu, cuda or cuda:N", m.device)
    need(m.max_model_len is None or m.max_model_len > 0, "model.max_model_len", "a positive integer or null",
         m.max_model_len)
    _check_cuda_graphs(cfg, need)
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
    one_of("kv_cache.dtype", kv.dtype, KV_DTYPES)
    need(kv.fp8_scale is None or (isinstance(kv.fp8_scale, (int, float)) and not isinstance(kv.fp8_scale, bool)
                                  and kv.fp8_scale > 0), "kv_cache.fp8_scale", "a positive number or null",
         kv.fp8_scale)
    need(s.max_num_batched_tokens > 0, "scheduler.max_num_batched_tokens", "a positive integer",
         s.max_num_batched_tokens)
    need(0 < s.chunk_size <= s.max_num_batched_tokens, "scheduler.chunk_size",
         f"positive and at most scheduler.max_num_batched_tokens ({s.max_num_batched_tokens})", s.chunk_size)
    need(s.max_num_seqs > 0, "scheduler.max_num_seqs", "a positive integer", s.max_num_seqs)
    one_of("scheduler.policy", s.policy, SCHEDULING_POLICIES)
    need(sv.host.strip() != "", "server.host", "a host name or address", sv.host)
    need(0 <= sv.port <= 65535, "server.port", "a TCP port in 0..65535 (0: any free port)", sv.port)
    need(sv.api_key is None or sv.api_key.strip() != "", "server.api_key", "a non-empty key or null", sv.api_key)
    need(sv.max_body_bytes >= 1024, "server.max_body_bytes", "at least 1024", sv.max_body_bytes)
    one_of("messenger.transport", ms.transport, TRANSPORTS)
    one_of("model.share_weights", m.share_weights, ("auto", "on", "off"))
    one_of("model.gemm_choice", m.gemm_choice, ("kernel", "measure"))
    # what the transport can do (pdkv/transports.py), not its name, decides the checks below
    caps = capabilities(ms.transport, ms) if ms.transport in TRANSPORTS else Capability.NONE
    need(0 <= ms.port <= 65535, "messenger.port", "a TCP port in 0..65535", ms.port)
    need(0 <= ms.fault_shm_fail_maps < 2**32, "messenger.fault_shm_fail_maps",
         "a count of grants in 0..2**32-1 (fault injection, tests only)", ms.fault_shm_fail_maps)
    need(len(ms.fault_shm_host_id) < 80, "messenger.fault_shm_host_id",
         "a boot id of under 80 characters (fault injection, tests only)", ms.fault_shm_host_id)
    need(all(n.strip() and n != "auto" for n in ms.rank_nics), "messenger.rank_nics",
         "one NIC device name per TP rank (not 'auto')", list(ms.rank_nics))
    need(not ms.rank_nics or "auto" in ms.nics or set(ms.rank_nics) <= set(ms.nics), "messenger.rank_nics",
         f"names from messenger.nics ({', '.join(ms.nics)})", list(ms.rank_nics))
    need(not ms.rank_nics or len(ms.rank_nics) == pc.tp, "messenger.rank_nics",
         f"one name per TP rank: {pc.tp} (parallel.tp)", list(ms.rank_nics))
    need(0 <= ms.remote_nics <= 16, "messenger.remote_nics", "0..16 (0: as many as this node has)", ms.remote_nics)
    need(1 <= ms.num_streams <= 64, "messenger.num_streams", "an integer in 1..64", ms.num_streams)
    one_of("messenger.libfabric.provider", ms.libfabric.provider, LIBFABRIC_PROVIDERS)
    doms = ms.libfabric.domains
    need(len(doms) <= 16 and all(d.strip() for d in doms) and len(set(doms)) == len(doms)
         and ("auto" not in doms or doms == ("auto",)), "messenger.libfabric.domains",
         "up to 16 distinct fabric domain names, each 'domain' or 'domain@fabric' (empty: the provider's "
         "first; [auto]: each rank's EFA devices nearest its GPU)", list(doms))
    need(ms.libfabric.domains != ("auto",) or ms.libfabric.provider == "efa", "messenger.libfabric.domains",
         "[auto] only with provider efa (it picks an EFA device from the topology); name the domain",
         list(ms.libfabric.domains))
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
    need(sv.grammar_cache_size > 0, "server.grammar_cache_size", "a positive integer", sv.grammar_cache_size)
    need(sv.grammar_compile_timeout_s > 0, "server.grammar_compile_timeout_s", "a positive number of seconds",
         sv.grammar_compile_timeout_s)
    need(sv.max_prompt_logprobs_tokens >= 0, "server.max_prompt_logprobs_tokens", "zero or positive",
         sv.max_prompt_logprobs_tokens)
    need(sv.reasoning_parser in (None, "deepseek_r1", "qwen3"), "server.reasoning_parser",
         "deepseek_r1, qwen3 or null", sv.reasoning_parser)
    need(sv.tool_parser in (None, "auto", "qwen3_coder", "hermes", "deepseek_v3"), "server.tool_parser",
         "qwen3_coder, hermes, deepseek_v3, auto or null", sv.tool_parser)
    need(sv.token_healing in ("auto", "on", "off") or isinstance(sv.token_healing, bool),
         "server.token_healing", "auto, on or off", sv.token_healing)
    need(ms.handshake_timeout_s > 0, "messenger.handshake_timeout_s", "a positive number of seconds",
         ms.handshake_timeout_s)
    need(4096 <= ms.max_frame_bytes <= (1 << 30), "messenger.max_frame_bytes", "4096..2**30 bytes", ms.max_frame_bytes)
    for name in ("max_control_conns", "max_handshakes", "max_control_per_source", "max_setups",
                 "max_grants_per_request", "max_grants_per_peer"):
        need(getattr(ms, name) > 0, f"messenger.{name}", "a positive integer", getattr(ms, name))
    tls = {"cert": ms.tls.cert, "key": ms.tls.key, "ca": ms.tls.ca}
    if any(tls.values()):
        for name, other in (("key", "cert"), ("cert", "key"), ("ca", "cert")):
            need(bool(tls[other]) or not tls[name], f"messenger.tls.{other}",
                 f"set when messenger.tls.{name} is (TLS needs cert, key and ca together)", tls[other])
        need(bool(tls["ca"]), "messenger.tls.ca", "the CA file that signs the peers' certificates (both sides "
             "verify each other; messenger.tls needs cert, key and ca together)", tls["ca"])
        if check_paths:
            for name, path in tls.items():
                need(Path(path).is_file(), f"messenger.tls.{name}", "a PEM file that exists", path)
    need(not ms.tls_data or Capability.SEALED_STREAMS in caps, "messenger.tls_data",
         f"false with transport {ms.transport} (its data path cannot be encrypted; transports that can: "
         f"{', '.join(names_with(Capability.SEALED_STREAMS))})", ms.tls_data)
    need(ms.lease_s > ms.heartbeat_s, "messenger.lease_s",
         f"longer than messenger.heartbeat_s ({ms.heartbeat_s})", ms.lease_s)
    for peer in ms.prefill_peers:
        host, _, port = peer.rpartition(":")
        need(bool(host) and port.isdigit() and 0 < int(port) <= 65535, "messenger.prefill_peers",
             "a list of host:port (each prefill node's messenger.control_port)", peer)
        if Capability.SAME_HOST_ONLY in caps:
            need(_is_this_host(host), "messenger.prefill_peers", f"addresses of this host (127.0.0.1, localhost, "
                 f"::1) with messenger.transport {ms.transport}, which connects processes of one host only", peer)
    dg = cfg.disagg
    need(dg.local_prefill_max_tokens >= 0, "disagg.local_prefill_max_tokens",
         "zero or a positive number of prompt tokens (0: every multi-token prompt goes to a prefill node)",
         dg.local_prefill_max_tokens)
    need(dg.max_prefill_queue_tokens is None or dg.max_prefill_queue_tokens >= 0, "disagg.max_prefill_queue_tokens",
         "null (no bound) or zero or a positive number of queued prompt tokens", dg.max_prefill_queue_tokens)
    need(0 <= dg.affinity_pages <= MAX_AFFINITY_PAGES, "disagg.affinity_pages",
         f"an integer in [0, {MAX_AFFINITY_PAGES}] (0: no prefix affinity)", dg.affinity_pages)
    need(dg.affinity_max_extra_tokens >= 0, "disagg.affinity_max_extra_tokens",
         "zero or a positive number of queued prompt tokens", dg.affinity_max_extra_tokens)
    one_of("disagg.kv_handoff", dg.kv_handoff, KV_HANDOFFS)
    need(0 <= pc.gpu_sm_percent <= 100, "parallel.gpu_sm_percent", "a share of the GPU's SMs in 0..100 (0: all)",
         pc.gpu_sm_percent)
    need(pc.gpu_sm_percent in (0, 100) or str(m.device).startswith("cuda"), "parallel.gpu_sm_percent",
         f"0 with model.device {m.device} (it splits a GPU; CPUs are split by parallel.cpus)", pc.gpu_sm_percent)
    if dg.kv_handoff == "share":
        need(ms.transport in ("shm", "auto"), "disagg.kv_handoff", "copy with messenger.transport "
             f"{ms.transport}: share computes KV in the decode node's memory, which only the shm "
             "transport (or auto's links through it) maps into the prefill process (both nodes on one "
             "host)", dg.kv_handoff)
        need(not str(m.device).startswith("cuda"), "disagg.kv_handoff", "copy on a GPU (share maps host "
             "memory; the GPU's is not shared between the processes here)", dg.kv_handoff)
        need(pc.tp == 1, "disagg.kv_handoff", "copy with parallel.tp > 1 (share needs whole pages in one "
             "rank's memory)", dg.kv_handoff)
        need(ms.staging != "cpu", "disagg.kv_handoff", "copy with messenger.staging cpu (the pages would be "
             "copied through the ring after all)", dg.kv_handoff)
    need(isinstance(dg.prefill_retries, int) and 0 <= dg.prefill_retries <= 16, "disagg.prefill_retries",
         "an integer in [0, 16] (0: a prefill node dying mid-transfer fails its requests)", dg.prefill_retries)
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
        if cfg.role in ("prefill", "decode") and sp.method in HANDOFF_METHODS:
            # NOTE: the proposer's KV is written straight into the decode node's proposer cache
            # (granted per request like the target's pages, on tcp and verbs): unstaged only,
            # the staging rings carry the target's pages only
            need(ms.staging != "cpu" and m.device == "cpu", "messenger.staging",
                 f"auto or off, with model.device cpu, for speculative.method {sp.method} on role {cfg.role} "
                 "(the proposer's KV hand-off does not go through the staging rings)",
                 f"{ms.staging} (model.device {m.device})")
    one_of("messenger.staging", ms.staging, STAGING_MODES)
    need(ms.staging_mib > 0, "messenger.staging_mib", "a positive size in MiB", ms.staging_mib)
    need(ms.staging_slot_kib > 0, "messenger.staging_slot_kib", "a positive size in KiB", ms.staging_slot_kib)
    need(cfg.role != "prefill" or ms.staging_slot_kib * 1024 <= ms.staging_mib * (1 << 20),
         "messenger.staging_slot_kib", f"at most messenger.staging_mib ({ms.staging_mib:g} MiB)", ms.staging_slot_kib)
    need(ms.staging_max_pending >= 0, "messenger.staging_max_pending", "zero or a positive integer",
         ms.staging_max_pending)
    if cfg.role in ("prefill", "decode") and m.device != "cpu":
        # NOTE: the transports move host memory; GPU KV goes through the staging ring (or, on
        # verbs, GPUDirect). What the host can do is checked when the node starts
        # (pdkv.disagg.staged.staging_mode), not here: validation imports no GPU module.
        need(ms.staging != "cpu", "messenger.staging", "auto or off with model.device cuda ('cpu' runs "
             "the staging pipeline on host KV through the CPU copy engine)", ms.staging)
        need(not (ms.staging == "off" and Capability.DEVICE_MEMORY not in caps), "messenger.staging",
             f"auto with model.device cuda and messenger.transport {ms.transport} ({ms.transport} moves host "
             "memory: GPU KV must be staged through pinned host memory)", ms.staging)
    _check_cluster(cfg, need, one_of)
    if cfg.role == "decode" and cfg.cluster.discovery == "static":
        need(bool(ms.prefill_peers), "messenger.prefill_peers",
             "at least one host:port for role decode (the prefill nodes to use; or cluster.discovery: etcd)",
             list(ms.prefill_peers))


def _check_cluster(cfg: Config, need, one_of) -> None:
    """cluster (pdkv/fleet): discovery, etcd endpoints and credentials, admission."""
    from urllib.parse import urlsplit

    cl, e, sv = cfg.cluster, cfg.cluster.etcd, cfg.server
    one_of("server.admission", sv.admission, ADMISSION)
    need(sv.ttft_slo_ms is None or sv.ttft_slo_ms > 0, "server.ttft_slo_ms", "a positive number of ms or null",
         sv.ttft_slo_ms)
    need(sv.admission == "queue" or sv.ttft_slo_ms is not None, "server.ttft_slo_ms",
         "set with server.admission shed (the budget a request is shed against)", sv.ttft_slo_ms)
    one_of("cluster.discovery", cl.discovery, DISCOVERY)
    ok_name = bool(cl.name) and all(c.isalnum() or c in "-_." for c in cl.name)
    need(ok_name, "cluster.name", "a name of letters, digits, '-', '_' or '.'", cl.name)
    need(not cl.node_id or all(c.isalnum() or c in "-_." for c in cl.node_id), "cluster.node_id",
         "empty or a name of letters, digits, '-', '_' or '.'", cl.node_id)
    need(cl.connect_timeout_s > 0, "cluster.connect_timeout_s", "a positive number of seconds", cl.connect_timeout_s)
    need(cl.lease_ttl_s >= 0, "cluster.lease_ttl_s", "0 (from messenger.lease_s) or a number of seconds",
         cl.lease_ttl_s)
    need(cl.drain_timeout_s > 0, "cluster.drain_timeout_s", "a positive number of seconds", cl.drain_timeout_s)
    need(cl.drain_notice_s >= 0, "cluster.drain_notice_s", "zero or a number of seconds", cl.drain_notice_s)
    need(e.timeout_s > 0, "cluster.etcd.timeout_s", "a positive number of seconds", e.timeout_s)
    need(e.prefix.startswith("/") and not e.prefix.endswith("/") or e.prefix == "", "cluster.etcd.prefix",
         "a key prefix like /pdkv (leading '/', none trailing)", e.prefix)
    if cl.discovery == "etcd":
        need(bool(e.endpoints), "cluster.etcd.endpoints", "at least one http(s)://host:port with discovery etcd",
             list(e.endpoints))
    for url in e.endpoints:
        u = urlsplit(url)
        need(u.scheme in ("http", "https") and bool(u.hostname) and u.port is not None and u.path in ("", "/"),
             "cluster.etcd.endpoints", "a list of http(s)://host:port (etcd's client URLs)", url)
    need(bool(e.user) == bool(e.password), "cluster.etcd.password", "set together with cluster.etcd.user",
         "<set>" if e.password else "")
    need(bool(e.cert) == bool(e.key), "cluster.etcd.key", "set together with cluster.etcd.cert", e.key)


def _check_cuda_graphs(cfg: Config, need) -> None:
    """model.cuda_graphs: a CUDA device, one rank, sizes that a step can use."""
    m = cfg.model
    sizes = m.cuda_graph_batch_sizes
    need(bool(sizes) and all(1 <= b <= MAX_CUDA_GRAPH_BATCH for b in sizes) and list(sizes) == sorted(set(sizes)),
         "model.cuda_graph_batch_sizes", f"a non-empty increasing list of batch sizes in 1..{MAX_CUDA_GRAPH_BATCH}",
         list(sizes))
    if not m.cuda_graphs:
        return
    need(m.device != "cpu", "model.cuda_graphs",
         "false with model.device cpu (CUDA graphs need model.device cuda or cuda:N)", m.cuda_graphs)
    need(cfg.parallel.tp == 1, "model.cuda_graphs",
         f"false with parallel.tp {cfg.parallel.tp} (ranks 1.. run their steps eagerly; graphs are captured "
         "for one rank only)", m.cuda_graphs)
    need(sizes[-1] <= cfg.scheduler.max_num_seqs, "model.cuda_graph_batch_sizes",
         f"at most scheduler.max_num_seqs ({cfg.scheduler.max_num_seqs}): a larger graph is never replayed",
         list(sizes))


def _check_dp(cfg: Config, need) -> None:
    """parallel.dp / parallel.ep (pdkv/dp): what can run; the model's own fit (dp divides the
    routed experts, a MoE model at all) is checked against config.json (pdkv.dp.group.check_dp_model)."""
    pc = cfg.parallel
    need(pc.dp >= 1, "parallel.dp", "a positive integer (data-parallel ranks)", pc.dp)
    if pc.dp > 1:
        need(pc.ep, "parallel.ep", f"true with parallel.dp {pc.dp} (data-parallel attention shares the MoE "
             "layers by expert parallelism; dense models: separate engines behind the router)", pc.ep)
        need(pc.tp == 1 or cfg.role == "colocated", "parallel.tp",
             f"1 with parallel.dp {pc.dp} on a {cfg.role} node (a disaggregated tp x dp group is not "
             "implemented; colocated, each DP rank may be a TP group)", pc.tp)
        need(pc.tp == 1 or not pc.expert_parallel, "parallel.expert_parallel",
             f"false with parallel.dp {pc.dp} and parallel.tp {pc.tp} (the routed experts are split whole "
             "across the DP ranks by parallel.ep, and each DP rank's sliced across its TP ranks)",
             pc.expert_parallel)
        need(cfg.speculative.method is None, "speculative.method",
             f"null with parallel.dp {pc.dp} (a verification would run a second forward in a lock step)",
             cfg.speculative.method)
    else:
        need(not pc.ep, "parallel.ep", "false with parallel.dp 1 (a TP node's expert split is "
             "parallel.expert_parallel)", pc.ep)

