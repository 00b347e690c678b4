"""The config sections: frozen dataclasses, the contract between the loader, the engine, the
server and the messenger. The engine is built from ``ModelConfig``, ``KVCacheConfig`` and
``SchedulerConfig`` (and ``ParallelConfig``); the server reads ``ServerConfig``; the messenger
and the disaggregated roles read ``MessengerConfig``.

NOTE: YAML is only an input format (loader.py). Derived values are properties, never stored twice.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pdkv.transports import config_names

ROLES = ("colocated", "prefill", "decode")
TRANSPORTS = config_names()  # the registered transports (pdkv/transports.py)
LIBFABRIC_PROVIDERS = ("auto", "efa", "tcp;ofi_rxm", "sockets", "shm")
STAGING_MODES = ("auto", "off", "cpu")
ATTENTION_BACKENDS = ("torch", "flashinfer")
DTYPES = ("float32", "bfloat16", "float16", "auto")
LAYOUTS = ("HND", "NHD")
KV_DTYPES = ("auto", "fp8_e4m3")  # kv_cache.dtype
SCHEDULING_POLICIES = ("fcfs", "priority")  # scheduler.policy (pdkv/engine/policy.py implements them)
MAX_AFFINITY_PAGES = 64  # disagg.affinity_pages: more never helps (the first pages decide)
MAX_CUDA_GRAPH_BATCH = 512  # model.cuda_graph_batch_sizes: each graph holds its activations


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
    # Decode-only steps (every row one new token) replayed as CUDA graphs captured at start, one
    # per batch size; a step is padded up to the nearest size (pdkv/engine/cuda_graphs.py). Mixed
    # prefill/decode steps, verifications and batches above the largest size run eagerly.
    cuda_graphs: bool = False  # CUDA devices only
    cuda_graph_batch_sizes: tuple[int, ...] = (1, 2, 4, 8, 16, 32)
    # CPU: GEMMs of up to 16 rows (decode steps) and single-token attention through pdkv's AVX2
    # kernels (models/cpu_kernels.py, models/attention/cpu_decode.py) where the CPU has AVX2+FMA;
    # false: torch's GEMMs and attention for every step. No effect on a GPU.
    cpu_kernels: bool = True
    # CPU, float32, more than one thread: "kernel": every GEMM of up to 64 rows on pdkv's kernel
    # (the same bits on any thread count and in every process); "measure": per weight shape and
    # row count, pdkv's kernel or torch's, whichever was faster when timed at load
    # (models/gemm_tuner.py) -- faster where MKL wins on this CPU, but two processes may choose
    # differently, so their outputs may differ in the last bits.
    gemm_choice: str = "kernel"  # kernel | measure
    # One copy of the weights per host (pdkv/shared_weights.py): "auto": a CPU process attaches to
    # the copy another process on this host serves for the same model (checked: fingerprint, sizes,
    # index checksum), else loads its own and serves it; "on": the same on a GPU too (CUDA IPC,
    # the importer on the owner's GPU); "off": always a private copy.
    share_weights: str = "off"  # auto | on | off


@dataclass(frozen=True)
class KVCacheConfig:
    page_size: int = 16  # tokens per page
    num_pages: int | None = None  # None: derived from memory_fraction (GPU) or memory_gib (CPU)
    memory_fraction: float = 0.85  # of free GPU memory, after weights
    memory_gib: float = 1.0  # CPU: KV cache size when num_pages is not set
    layout: str = "HND"  # HND: [pages, 2, kv_heads, P, head_dim]; NHD: [pages, 2, P, kv_heads, head_dim]
    prefix_caching: bool = True  # reuse cached full pages of earlier requests (pdkv/kv/prefix_cache.py)
    # Element type of the cache: "auto" (the model's dtype) or "fp8_e4m3" (float8_e4m3fn: half a
    # bf16 cache's bytes per token and per transfer; K/V stored divided by a per-layer scale).
    dtype: str = "auto"
    # fp8_e4m3 only: the scale of every layer's K and V (or MLA latent). null: the checkpoint's
    # k_scale / v_scale where it has them, else 1.0. To calibrate, run the model with
    # dtype auto on representative prompts and set max |K|, |V| / 448 (e4m3's largest value).
    fp8_scale: float | None = None


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_batched_tokens: int = 2048  # token budget per step (prefill chunks + decodes)
    chunk_size: int = 512  # most prefill tokens of one request in one step
    max_num_seqs: int = 64  # most running requests
    # The order requests wait in and the preemption victim (pdkv/engine/policy.py): fcfs (arrival)
    # or priority (the request's "priority", lower first, then arrival; as vLLM's policy field)
    policy: str = "fcfs"


@dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    max_body_bytes: int = 1 << 20
    idle_timeout_s: float = 30.0  # a connection with no request in progress this long is closed
    keepalive_timeout_s: float = 15.0  # aiohttp's keep-alive bound between requests
    max_connections: int = 1024  # beyond it, idle connections are closed oldest first
    max_prompts_x_n: int = 256  # prompts x n of one request (each is an engine request); more is a 400
    max_waiting_requests: int = 4096  # engine requests waiting for admission; beyond: 503 + Retry-After
    # Structured output (server/structured.py): compiled grammars kept, and how long one compile
    # may take before the request is refused (it is compiled off the event loop).
    grammar_cache_size: int = 64
    grammar_compile_timeout_s: float = 10.0
    max_prompt_logprobs_tokens: int = 2048  # echo + logprobs: longer prompts are refused (a 400)
    # Chat output parsers (server/reasoning.py, server/tools/): reasoning_parser deepseek_r1 |
    # qwen3 | null (reasoning_content off); tool_parser qwen3_coder | hermes | deepseek_v3 |
    # auto (from the model's architecture) | null (tool calls are not parsed)
    reasoning_parser: str | None = None
    tool_parser: str | None = "auto"
    # Token healing for requests that do not say (their "token_healing" field): auto = on for
    # /v1/completions prompts given as text, off for chat (its template ends on special
    # tokens) and for prompts given as token ids (the client's own tokenization); on; off.
    # YAML reads a bare on/off as true/false: both spellings are taken.
    token_healing: str | bool = "auto"
    # SLO-aware admission on a decode node (pdkv/fleet/admission.py): a request whose expected
    # time to first token (its prompt against the chosen prefill node's queue and measured rate)
    # exceeds ttft_slo_ms is prefilled here when the prefill chooser allows it, else -- with
    # admission "shed" -- answered at once with 503 + Retry-After instead of queued past its
    # budget. "queue" (default): every request waits its turn. null ttft_slo_ms: no budget.
    admission: str = "queue"  # queue | shed
    ttft_slo_ms: float | None = None


@dataclass(frozen=True)
class TLSConfig:
    # Optional TLS for the control channel (pdkv/tls.py): all three PEM files or none. Both sides
    # present their certificate and verify the peer's against ``ca`` (mutual); the cluster
    # secret's handshake still runs inside. The data transport is not covered.
    cert: str = ""  # this node's certificate (chain)
    key: str = ""  # its private key (unencrypted PEM)
    ca: str = ""  # the CA that signs every node of the cluster (use one dedicated to it)


@dataclass(frozen=True)
class LibfabricConfig:
    # messenger.transport libfabric (pdkv/csrc/fabric.c): the provider ("auto": the first with RDM
    # endpoints, RMA and remote CQ data) and its fabric domain (EFA: the device, e.g.
    # "rdmap16s27-rdm"; tcp;ofi_rxm / sockets: the interface, e.g. "lo"); empty: the first.
    provider: str = "auto"  # auto | efa | tcp;ofi_rxm | sockets | shm
    domains: tuple[str, ...] = ()


@dataclass(frozen=True)
class MessengerConfig:
    # Reserved for the disaggregation issues: filled in as they land.
    # tcp | verbs | libfabric | shm (both nodes on this host: pdkv/csrc/shm.c) | auto (shm to
    # peers of this host, tcp to the others: pdkv/csrc/auto.c)
    transport: str = "tcp"
    # shm: where the decode node's registered memory is made shared (an unnamed file; its free
    # space is checked at start). Prefill peers map only their granted pages of it.
    shm_dir: str = "/dev/shm"
    # shm: the decode node's pool file allocated whole at start (true: a full shm_dir fails the
    # start, never a request), or as its pages are first used (false: only what is used costs
    # memory, but a shm_dir that fills up meanwhile kills the node with SIGBUS at that first use)
    shm_preallocate: bool = True
    # fault injection (tests only): the boot id this node's shm connection info claims (a peer
    # that says it is on the host but is not), and how many grants of peers fail to map here
    fault_shm_host_id: str = ""
    fault_shm_fail_maps: int = 0
    host: str = "127.0.0.1"
    port: int = 0
    nics: tuple[str, ...] = ("auto",)
    # verbs, one NIC name per TP rank (rank r's pages leave through rank_nics[r]); empty: the NIC
    # nearest each rank's GPU (pdkv.topo), or the ranks spread over `nics` without GPUs
    rank_nics: tuple[str, ...] = ()
    remote_nics: int = 0  # verbs: peer NICs to prepare queue pairs toward (0: as many as ours)
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
    # Node authentication (pdkv/auth.py). The secret comes from $PDKV_CLUSTER_SECRET or this file
    # (mode 0600), never the command line; without one a node listens on loopback only unless
    # insecure is true (logged loudly).
    secret_file: str = ""
    insecure: bool = False
    handshake_timeout_s: float = 10.0  # a control connection must authenticate + say HELLO + CONNECT within this
    max_frame_bytes: int = 16 << 20  # control frames after the handshake (before it: 64 KiB)
    max_control_conns: int = 64  # prefill: established links (decode nodes) held at once
    # prefill: control connections still handshaking held at once; when full, the oldest of the
    # source holding most gives its place to a newcomer (pdkv/disagg/control_admission.py)
    max_handshakes: int = 32
    max_control_per_source: int = 16  # prefill: handshaking, and links, from one source address
    max_setups: int = 4  # data-path set-ups (Messenger.complete) running at once, each in a thread
    # decode: narrow grants (pdkv/disagg/grants.py) per request and held by one prefill peer at
    # once: ranges = (KV ranks x layers x runs of pages) + 1; on verbs each is an MR (registered
    # at PREFILL, deregistered when the request's slot ends). Beyond: the request is refused (503).
    max_grants_per_request: int = 16384
    max_grants_per_peer: int = 65536
    # Staging KV pages through host memory (pdkv/disagg/staged.py): "auto" stages GPU KV where the
    # NIC cannot reach it (tcp; verbs without GPUDirect), host KV goes direct; "cpu" forces the
    # same pipeline on host KV through the CPU copy engine (tests, benchmarks); "off" never stages.
    staging: str = "auto"  # auto | off | cpu
    staging_mib: float = 64.0  # the staging ring (pinned on a GPU host), per node
    staging_slot_kib: int = 1024  # prefill: one copy job's slot (a layer's pages are cut to fit)
    staging_max_pending: int = 64  # prefill: copies waiting for a free slot; beyond, the request fails
    tls: TLSConfig = field(default_factory=TLSConfig)  # empty: control connections in clear
    # tcp: encrypt and authenticate the data streams too (AES-256-GCM records keyed from the
    # authenticated control session; needs a cluster secret and libcrypto). Both nodes alike.
    tls_data: bool = False
    libfabric: LibfabricConfig = field(default_factory=LibfabricConfig)


@dataclass(frozen=True)
class DisaggConfig:
    # A decode node's choice of where each prompt is prefilled (pdkv/disagg/choice.py). Defaults
    # measured with `python -m pdkv.bench where` on the default model, see docs/BENCHMARKS.md
    # ("Where to prefill").
    # A prompt whose uncached part (tokens the local prefix cache does not hold) is at most this
    # long is prefilled here: the round trip to a prefill node costs more than computing it
    # (measured: local 1.5-1.9x faster up to 192 tokens, slower from 256).
    local_prefill_max_tokens: int = 128
    # A prefill node is saturated while its queue (prompt tokens its last heartbeat reported not
    # yet computed, plus those this node sent it since) is at least this long; with every live
    # one saturated the prompt is prefilled here. 0: always prefill here; null: no bound.
    # (measured: ~1 s of the prefill node's work, 3x a 1024-token prompt's local prefill)
    max_prefill_queue_tokens: int | None = 8192
    # No prefill node connected: prefill here (true), or refuse with a 503 + Retry-After (false:
    # strict disaggregation, e.g. a decode node that must never run a prompt's prefill).
    local_fallback: bool = True
    # Prefix affinity: the first affinity_pages full pages of each prompt sent remotely are
    # remembered (bounded map) with the node that prefilled them; a later prompt starting the
    # same way goes to that node if its queue is within affinity_max_extra_tokens of the least
    # loaded node's (its prefix cache may hold those pages). 0 pages: off.
    affinity_pages: int = 4
    affinity_max_extra_tokens: int = 2048
    # How a prefill node hands a request's KV to a decode node of this host: "copy" computes it
    # in its own pages and writes them; "share" (messenger.transport shm, CPU, tp 1) computes it
    # straight into the decode node's reserved pages, mapped here (pdkv/disagg/kv_share.py);
    # "auto": share where it applies and the prefill node keeps no prefix cache, else copy.
    kv_handoff: str = "auto"  # auto | copy | share
    # A prefill node dying mid-transfer: this node revokes its grants and sends the PREFILL to
    # another live prefill node, at most this many times per request (then, or with no other
    # node live, the request fails with a 503 + Retry-After, which a router retries). 0: off.
    prefill_retries: int = 2


@dataclass(frozen=True)
class ParallelConfig:
    # Tensor parallelism on one node: rank 0 runs the engine (scheduler, server, messenger) and
    # starts ranks 1..tp-1 as processes that follow its steps. CPU: gloo, KV in shared memory;
    # GPU: NCCL, rank r on cuda:(N + r) for model.device cuda:N, KV in cuMem shared with rank 0.
    tp: int = 1
    timeout_s: float = 120.0  # a collective (all-reduce) that waits longer fails the step
    startup_timeout_s: float = 600.0  # ranks must start and load their weights within this
    # MoE: each rank holds whole experts [r * E / tp, (r + 1) * E / tp) instead of a slice of every
    # expert (models/parallel.py). FP8 checkpoints need it where tp would cut 128-blocks of the
    # experts' rows (Qwen3-Coder-480B-FP8 at tp 8: 2560 / 8 = 320), as vLLM's --enable-expert-parallel.
    expert_parallel: bool = False
    cpus: str = ""  # CPUs this node may use ("0", "0-3,8"; taskset syntax); "": all (pdkv.cpus)
    # The share of the GPU's SMs this process may use, 1..100 (0: all), so a prefill and a decode
    # process split one GPU: MPS's active thread percentage, else a green context (pdkv/gpu/sm_split.py)
    gpu_sm_percent: int = 0
    # Data-parallel attention with expert-parallel MoE (pdkv/dp): dp ranks, each its own requests,
    # scheduler and latent KV cache; the routed experts split whole across them (dp divides the
    # expert count), tokens travel to their experts by all-to-all. ep must be true with dp > 1.
    dp: int = 1
    ep: bool = False


@dataclass(frozen=True)
class EtcdConfig:
    # etcd v3 (its JSON gateway, /v3/...): http(s)://host:port of each member; TLS with ca (and a
    # client certificate: cert + key); user + password for etcd's own authentication.
    endpoints: tuple[str, ...] = ()
    prefix: str = "/pdkv"  # keys: <prefix>/<cluster.name>/<role>/<node_id>
    ca: str = ""
    cert: str = ""
    key: str = ""
    user: str = ""
    password: str = ""
    timeout_s: float = 2.0  # one etcd call (a watch stream excepted)


@dataclass(frozen=True)
class ClusterConfig:
    # Fleet membership (pdkv/fleet, docs/FLEET.md). static: prefill peers and router nodes come
    # from the config files (messenger.prefill_peers, router nodes); etcd: every node registers
    # under a lease and decode nodes / routers watch who is there. etcd is never the trust anchor:
    # a prefill node found there still has to pass the authenticated control handshake.
    discovery: str = "static"  # static | etcd
    name: str = "default"
    node_id: str = ""  # the key's last part; "": <host>-<server port>
    etcd: EtcdConfig = field(default_factory=EtcdConfig)
    # etcd not answering at start-up: fail after connect_timeout_s (required) or start without
    # it, registering once it answers (false).
    required: bool = True
    connect_timeout_s: float = 5.0
    lease_ttl_s: int = 0  # the registration's lease; 0: from messenger.lease_s (at least 2 s)
    # Draining (SIGTERM or POST /admin/drain): how long in-flight requests may take before the
    # node stops anyway (its exit status is then 1), and how long a draining node stays
    # registered as draining before it deregisters (time for watchers to stop choosing it).
    drain_timeout_s: float = 30.0  # Kubernetes' default terminationGracePeriodSeconds
    drain_notice_s: float = 0.5


DISCOVERY = ("static", "etcd")
ADMISSION = ("queue", "shed")
SPEC_METHODS = ("ngram", "draft", "mtp")
MAX_SPEC_TOKENS = 16  # drafts per step: more never pays (acceptance decays geometrically)


@dataclass(frozen=True)
class DraftModelConfig:
    path: str = ""  # a local Hugging Face folder with the target's tokenizer (method draft)
    num_pages: int | None = None  # the draft's own KV pages; None: as many as the target's


@dataclass(frozen=True)
class SpeculativeConfig:
    # Speculative decoding (pdkv/engine/spec): a proposer drafts up to num_tokens tokens per
    # running request, the target verifies them in one forward pass. None: off.
    method: str | None = None  # ngram | draft | mtp
    num_tokens: int = 4  # k: draft tokens per verification step
    ngram_min: int = 1  # ngram: shortest suffix matched against prompt + output (vLLM prompt_lookup_min)
    ngram_max: int = 3  # ngram: longest suffix tried first (vLLM prompt_lookup_max)
    draft_model: DraftModelConfig = field(default_factory=DraftModelConfig)


@dataclass(frozen=True)
class Config:
    role: str = "colocated"
    model: ModelConfig = field(default_factory=ModelConfig)
    kv_cache: KVCacheConfig = field(default_factory=KVCacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    server: ServerConfig = field(default_factory=ServerConfig)
    messenger: MessengerConfig = field(default_factory=MessengerConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    disagg: DisaggConfig = field(default_factory=DisaggConfig)
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    source: str = "<defaults>"  # the file this config came from, for error messages


class ConfigError(ValueError):
    """A config that cannot be used. The message names the file (or --set), the field and what
    was expected: ``configs/x.yaml: kv_cache.layout must be one of HND, NHD, got 'HDN'``."""


