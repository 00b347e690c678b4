"""``pdkv plan``: what one request costs a disaggregated deployment, from its files alone.

    pdkv plan -c configs/deepseek-r1/cluster-tp8.yaml [--prompt-len 4096] [--topo DIR] [--json]

Reads the deployment (a cluster file: shared sections plus ``prefill:`` / ``decode:`` overrides
and a ``deployment:`` section with node counts; or a single role file, planned against a peer
of the same TP degree) and the model's ``config.json`` only: the model is built on the meta
device, no weight is read. For one request of ``--prompt-len`` tokens it prints the KV bytes
per token and per request, the shard plan's pages and writes per (prefill rank, decode rank)
pair for that request's seeded replica choice, the bytes each NIC carries (rank r sits on the
r-th GPU in PCI order and sends through its nearest RDMA NIC, as pdkv/topo places it), the
immediate count the decode node waits for, and the weight memory of a rank on each side.

The decode node holds the prompt's last token back (DESIGN.md), so prompt_len - 1 tokens move;
every write moves whole pages, and one more write carries the last hidden state.
"""

from __future__ import annotations

import collections
import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path

import yaml

from pdkv.errors import PdkvError

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
KV_DTYPES = {"fp8_e4m3": ("float8_e4m3fn", 1)}  # kv_cache.dtype besides "auto" (the model's)
REQUEST_TOKENS = 4096  # the verdict's unit: concurrent requests of this many tokens


class PlanError(PdkvError, ValueError):
    """A deployment file ``pdkv plan`` cannot read; the message names the file and the field."""


@dataclass(frozen=True)
class Side:
    role: str
    tp: int
    nodes: int  # nodes of this role in the deployment
    engines_per_node: int  # data parallel: independent engines (each tp ranks) on one node
    dtype: str
    page_size: int
    layout: str
    kv_dtype: str = "bfloat16"  # the cache's element type, resolved (kv_cache.dtype)
    memory_fraction: float = 0.85  # kv_cache.memory_fraction: of the GPU memory left after weights
    expert_parallel: bool = False  # parallel.expert_parallel: whole experts per rank
    dp: int = 1  # parallel.dp with parallel.ep: a data-parallel expert-parallel group of dp ranks


@dataclass(frozen=True)
class Deployment:
    source: str
    model_path: Path
    prefill: Side
    decode: Side
    gpu_memory_gib: float | None = None  # deployment.gpu_memory_gib: each GPU's memory


def _merge(base: dict, over: dict) -> dict:
    out = dict(base)
    for k, v in (over or {}).items():
        out[k] = _merge(out.get(k) or {}, v) if isinstance(v, dict) else v
    return out


def _get(cfg: dict, dotted: str, source: str, default=None, kind=None):
    node = cfg
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node or node[part] is None:
            if default is None:
                raise PlanError(f"{source}: missing {dotted}")
            return default
        node = node[part]
    if kind is int and (isinstance(node, bool) or not isinstance(node, int) or node < 1):
        raise PlanError(f"{source}: {dotted} must be a positive integer, got {node!r}")
    return node


def load_deployment(path: str | Path) -> Deployment:
    source = str(path)
    try:
        raw = yaml.safe_load(Path(path).read_text(encoding="utf-8")) or {}
    except OSError as e:
        raise PlanError(f"{source}: cannot read ({e.strerror})") from None
    except yaml.YAMLError as e:
        raise PlanError(f"{source}: not valid YAML ({e})") from None
    if not isinstance(raw, dict):
        raise PlanError(f"{source}: expected a mapping at the top level")
    dep = raw.get("deployment") or {}
    shared = {k: v for k, v in raw.items() if k not in ("prefill", "decode", "deployment")}
    sides = {}
    for role in ("prefill", "decode"):
        cfg = _merge(shared, raw.get(role) or {}) if ("prefill" in raw or "decode" in raw) else shared
        where = f"{source} ({role})"
        dtype = _get(cfg, "model.dtype", where, "bfloat16")
        if dtype not in DTYPE_BYTES:
            raise PlanError(f"{where}: model.dtype must be one of {', '.join(DTYPE_BYTES)} (resolved), got {dtype!r}")
        layout = _get(cfg, "kv_cache.layout", where, "HND")
        if layout not in ("HND", "NHD"):
            raise PlanError(f"{where}: kv_cache.layout must be HND or NHD, got {layout!r}")
        kv_dtype = _get(cfg, "kv_cache.dtype", where, "auto")
        if kv_dtype != "auto" and kv_dtype not in KV_DTYPES:
            raise PlanError(f"{where}: kv_cache.dtype must be auto or {', '.join(KV_DTYPES)}, got {kv_dtype!r}")
        fraction = _get(cfg, "kv_cache.memory_fraction", where, 0.85)
        if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0 < fraction <= 1:
            raise PlanError(f"{where}: kv_cache.memory_fraction must be in (0, 1], got {fraction!r}")
        sides[role] = Side(role, _get(cfg, "parallel.tp", where, 1, int), _get(dep, f"{role}_nodes", source, 1, int),
                           _get(dep, f"{role}_engines_per_node", source, 1, int), dtype,
                           _get(cfg, "kv_cache.page_size", where, 16, int), layout,
                           dtype if kv_dtype == "auto" else KV_DTYPES[kv_dtype][0], float(fraction),
                           _get(cfg, "parallel.expert_parallel", where, False) is True,
                           _dp(cfg, where))
    gpu = dep.get("gpu_memory_gib")
    if gpu is not None and (isinstance(gpu, bool) or not isinstance(gpu, (int, float)) or gpu <= 0):
        raise PlanError(f"{source}: deployment.gpu_memory_gib must be a positive number, got {gpu!r}")
    for field in ("dtype", "page_size", "layout", "kv_dtype"):
        if getattr(sides["prefill"], field) != getattr(sides["decode"], field):
            raise PlanError(f"{source}: prefill and decode disagree on {field} ({getattr(sides['prefill'], field)!r} "
                            f"vs {getattr(sides['decode'], field)!r}); the handshake would refuse them")
    model = _get(_merge(shared, raw.get("decode") or {}), "model.path", source)
    model_path = Path(model)
    if not model_path.is_absolute() and not model_path.exists():
        model_path = Path(path).parent / model  # relative to the file, when not to the working dir
    if not (model_path / "config.json").is_file():
        raise PlanError(f"{source}: model.path {model!r} has no config.json")
    return Deployment(source, model_path, sides["prefill"], sides["decode"],
                      None if gpu is None else float(gpu))


def _dp(cfg: dict, where: str) -> int:
    dp = _get(cfg, "parallel.dp", where, 1, int)
    if dp > 1 and _get(cfg, "parallel.ep", where, False) is not True:
        raise PlanError(f"{where}: parallel.dp={dp} needs parallel.ep: true (data-parallel attention shares the "
                        "MoE layers by expert parallelism)")
    if dp > 1 and _get(cfg, "parallel.tp", where, 1, int) != 1:
        raise PlanError(f"{where}: parallel.tp must be 1 with parallel.dp={dp}")
    return dp


def weight_bytes_per_rank(arch, tp: int, dtype: str, quant=None, source: str = "config.json",
                          expert_parallel: bool = False, dp: int = 1) -> list[int]:
    """Parameter bytes of each of ``tp`` ranks in the checkpoint's real dtype (FP8 + block scales
    for a quantized one: models/footprint.py), from models built on the meta device. Every rank
    holds the same shapes (TPLayout only accepts even splits), so rank 0 is built and repeated.
    Raises PlanError for a degree the model cannot split; ModelLoadError (what the loader would
    say) for a split that cuts an FP8 block."""
    import torch  # noqa: PLC0415

    from pdkv.models.footprint import rank_weight_bytes  # noqa: PLC0415
    from pdkv.models.parallel import DataParallelError, TensorParallelError  # noqa: PLC0415

    try:
        return [rank_weight_bytes(arch, tp, getattr(torch, dtype), quant, source, expert_parallel, dp)] * max(tp, dp)
    except (TensorParallelError, DataParallelError) as e:
        raise PlanError(f"{source}: {e}") from None


def memory_verdict(weights: int | None, kv_per_token: int, gpu_gib: float | None, fraction: float,
                   refused: str | None = None) -> dict:
    """One rank of a role on a GPU of ``gpu_gib``: fits (KV room in tokens and concurrent
    REQUEST_TOKENS-token requests) or not (short by how many bytes). The KV cache gets
    ``fraction`` of what the weights leave (kv_cache.memory_fraction, as the engine sizes it)."""
    if refused is not None:
        return {"fits": False, "refused": refused, "text": f"does not load: {refused}"}
    if gpu_gib is None:
        return {"fits": None, "text": "no GPU memory given (--gpu-memory-gib or deployment.gpu_memory_gib)"}
    gpu = int(gpu_gib * (1 << 30))
    if weights >= gpu:
        short = weights - gpu
        return {"fits": False, "gpu_bytes": gpu, "short_bytes": short,
                "text": f"does not fit: weights exceed the {gpu_gib:g} GiB GPU by {short / (1 << 30):.2f} GiB"}
    kv = int((gpu - weights) * fraction)
    tokens = kv // kv_per_token
    n = tokens // REQUEST_TOKENS
    return {"fits": tokens > 0, "gpu_bytes": gpu, "kv_bytes": kv, "kv_tokens": tokens, "requests_4k": n,
            "text": f"fits: {_gib(gpu - weights)} left after weights, KV room for {tokens:,} tokens "
                    f"({n:,} concurrent {REQUEST_TOKENS}-token requests)"}


def _nics(topo, num_ranks: int) -> list[str]:
    """The NIC rank r sends through: the nearest RDMA device of the r-th GPU (PCI order)."""
    from pdkv.topo import placement  # noqa: PLC0415

    out = []
    for r in range(num_ranks):
        if topo is None or r >= len(topo.gpus):
            out.append(f"rank{r}:no-gpu")
            continue
        nics = placement(topo, topo.gpus[r].bus_id, ["auto"]).nics
        out.append(nics[0] if nics else f"gpu{r}:no-nic")
    return out


def plan_request(dep: Deployment, prompt_len: int, topo=None, request_id: str = "req-0",
                 num_requests: int = 1000, gpu_memory_gib: float | None = None) -> dict:
    """The report (a plain dict, what ``--json`` prints). ``gpu_memory_gib``: the GPU to plan
    for (default the deployment's ``gpu_memory_gib``)."""
    from pdkv.models.config import parse_arch_config  # noqa: PLC0415
    from pdkv.models.kv_layout import kv_geometry  # noqa: PLC0415
    from pdkv.models.loader import read_json  # noqa: PLC0415
    from pdkv.disagg.writes import expected_writes  # noqa: PLC0415
    from pdkv.shard import plan_transfers, request_seed  # noqa: PLC0415

    if isinstance(prompt_len, bool) or not isinstance(prompt_len, int) or prompt_len < 1:
        raise PlanError(f"--prompt-len must be a positive integer, got {prompt_len!r}")
    from pdkv.models.footprint import kv_bytes_per_token  # noqa: PLC0415
    from pdkv.models.quant import parse_quant_config  # noqa: PLC0415
    from pdkv.errors import ModelLoadError  # noqa: PLC0415
    from pdkv.shard.spec import DTYPE_SIZES  # noqa: PLC0415

    config_path = str(dep.model_path / "config.json")
    hf_config = read_json(dep.model_path / "config.json")
    arch = parse_arch_config(hf_config, config_path)
    quant = parse_quant_config(hf_config, config_path)
    p, d = dep.prefill, dep.decode
    geo = kv_geometry(arch, p.page_size, p.kv_dtype, p.layout)
    plan = plan_transfers(p.tp, d.tp, geo)
    L, elem = arch.num_layers, DTYPE_SIZES[p.kv_dtype]
    per_token = L * geo.kv_parts * geo.num_kv_heads * geo.head_dim * elem  # one copy of the cache
    tokens = prompt_len - 1
    pages = math.ceil(tokens / p.page_size)
    seed = request_seed(request_id)
    pair_rows, by_src = [], collections.Counter()
    for pair in plan.active_pairs(seed):
        seg_bytes = sum(s.length for s in pair.segments)
        row = {"prefill_rank": pair.prefill_rank, "decode_rank": pair.decode_rank, "pages": pages,
               "writes": len(pair.segments) * pages * L, "bytes": seg_bytes * pages * L}
        pair_rows.append(row)
        by_src[pair.prefill_rank] += row["bytes"]
    hidden = arch.hidden_size * elem
    src_nics, dst_nics = _nics(topo, p.tp), _nics(topo, d.tp)
    nic_tx, nic_rx = collections.Counter(), collections.Counter()
    for row in pair_rows:
        nic_tx[src_nics[row["prefill_rank"]]] += row["bytes"]
        nic_rx[dst_nics[row["decode_rank"]]] += row["bytes"]
    nic_tx[src_nics[0]] += hidden  # the hidden state leaves from prefill rank 0 for decode rank 0
    nic_rx[dst_nics[0]] += hidden
    share = collections.Counter()  # bytes per prefill rank over many seeded requests
    for i in range(num_requests):
        for pair in plan.active_pairs(request_seed(f"{request_id}-{i}")):
            share[pair.prefill_rank] += sum(s.length for s in pair.segments)
    total_share = sum(share.values()) or 1
    gpu = gpu_memory_gib if gpu_memory_gib is not None else dep.gpu_memory_gib
    weights, memory, known = {}, {}, {}
    for s in (p, d):
        refused = None
        key = (s.tp, s.dtype, s.expert_parallel, s.dp)
        if key not in known:  # both roles alike (the common case): built once
            try:
                known[key] = (weight_bytes_per_rank(arch, s.tp, s.dtype, quant, config_path, s.expert_parallel,
                                                    s.dp), None)
            except ModelLoadError as e:  # an FP8 block the split would cut: the loader refuses it
                known[key] = (None, str(e))
        weights[s.role], refused = known[key]
        w = None if weights[s.role] is None else weights[s.role][0]
        memory[s.role] = {"kv_bytes_per_token_per_rank": kv_bytes_per_token(arch, s.tp, elem),
                          "weight_bytes_per_rank": w, "gpu_memory_gib": gpu,
                          **memory_verdict(w, kv_bytes_per_token(arch, s.tp, elem), gpu, s.memory_fraction,
                                           refused)}
    dp_vs_tp = None
    if d.dp > 1:  # the same GPUs as one TP-dp decode node: what DP changes per request and per node
        tp_plan = plan_transfers(p.tp, d.dp, geo)
        tp_wire = sum(sum(sg.length for sg in pair.segments) * pages * L for pair in tp_plan.active_pairs(seed))
        dp_wire = sum(r["bytes"] for r in pair_rows)
        try:
            tp_w = weight_bytes_per_rank(arch, d.dp, d.dtype, quant, config_path, d.expert_parallel)[0]
            tp_mem = memory_verdict(tp_w, kv_bytes_per_token(arch, d.dp, elem), gpu, d.memory_fraction)
        except (PlanError, ModelLoadError) as e:
            tp_w, tp_mem = None, memory_verdict(None, 0, gpu, d.memory_fraction, str(e))
        dp_mem = memory[d.role]
        dp_vs_tp = {"dp": d.dp, "dp_wire_bytes": dp_wire + hidden, "tp_wire_bytes": tp_wire + hidden,
                    "tp_weight_bytes_per_rank": tp_w, "tp_memory": tp_mem,
                    # TP replicates the latent: a node holds what one rank holds; DP ranks hold different requests
                    "node_kv_tokens_tp": tp_mem.get("kv_tokens"),
                    "node_kv_tokens_dp": None if dp_mem.get("kv_tokens") is None else d.dp * dp_mem["kv_tokens"]}
    return {
        "deployment": dep.source, "model": str(dep.model_path), "architecture": arch.architecture,
        "num_layers": L, "cache": ("latent" if geo.kv_parts == 1 else "kv"),
        "values_per_token_per_layer": geo.kv_parts * geo.num_kv_heads * geo.head_dim,
        "dtype": p.dtype, "kv_dtype": p.kv_dtype, "page_size": p.page_size, "layout": p.layout,
        "weights_dtype": "fp8 (e4m3, block scales)" if quant is not None else p.dtype,
        "prefill": asdict(p), "decode": asdict(d),
        "kv_bytes_per_token": per_token, "prompt_len": prompt_len, "tokens_moved": tokens,
        "kv_bytes_per_request": per_token * tokens, "pages": pages,
        "page_bytes_per_rank_per_layer": plan.decode.page_bytes,
        "replicated": geo.replicated, "decode_copies": plan.decode.num_replicas,
        "request_id": request_id, "pairs": pair_rows,
        "wire_bytes": sum(r["bytes"] for r in pair_rows) + hidden, "hidden_state_bytes": hidden,
        "nic_bytes": {"prefill": dict(nic_tx), "decode": dict(nic_rx)},
        "expected_immediates": expected_writes(plan, pages, L),
        "expected_writes_per_decode_rank": [plan.expected_writes(r, pages, L) for r in range(d.tp)],
        # a DP prefill group: each request is sent by the rank it was placed on (by load: evenly)
        "prefill_rank_share": ({str(r): share[r] / total_share for r in range(p.tp)} if p.dp == 1
                               else {str(r): 1 / p.dp for r in range(p.dp)}),
        "weight_bytes_per_rank": weights, "memory": memory, "dp_vs_tp": dp_vs_tp,
    }


def _gib(n: int) -> str:
    return f"{n / (1 << 30):.2f} GiB" if n >= 1 << 30 else f"{n / (1 << 20):.2f} MiB"


def render(r: dict) -> str:
    p, d = r["prefill"], r["decode"]
    dp = f" x {d['engines_per_node']} engines/node (data parallel)" if d["engines_per_node"] > 1 else ""
    if d.get("dp", 1) > 1:
        dp = (f" DP{d['dp']}-EP: {d['dp']} ranks, each its own requests and latent cache, 1/{d['dp']} of the routed "
              "experts (all-to-all)")
    pdp = (f" DP{p['dp']}-EP: {p['dp']} ranks, each computing and sending its own requests"
           if p.get("dp", 1) > 1 else "")
    lines = [
        f"deployment {r['deployment']}: {r['architecture']}, {r['num_layers']} layers, {r['dtype']}, "
        f"page {r['page_size']} tokens, {r['layout']}",
        f"  prefill: {p['nodes']} node(s), TP{p['tp']}{pdp}    decode: {d['nodes']} node(s), TP{d['tp']}{dp}",
        f"  cache: {r['cache']}, {r['values_per_token_per_layer']} values/token/layer"
        + (", replicated on every rank" if r["replicated"] else ""),
        f"  KV bytes per token: {r['kv_bytes_per_token']:,}",
        f"one request, prompt {r['prompt_len']} tokens ({r['tokens_moved']} move; the last is decoded):",
        f"  KV bytes: {r['kv_bytes_per_request']:,} ({_gib(r['kv_bytes_per_request'])}); {r['pages']} pages",
        f"  on the wire: {r['wire_bytes']:,} bytes ({_gib(r['wire_bytes'])}) = {r['decode_copies']} decode "
        f"cop{'y' if r['decode_copies'] == 1 else 'ies'} of whole pages + {r['hidden_state_bytes']} B hidden state",
        f"  pairs for request {r['request_id']!r} (seeded replica choice):",
    ]
    for row in r["pairs"]:
        lines.append(f"    p{row['prefill_rank']} -> d{row['decode_rank']}: {row['pages']} pages, "
                     f"{row['writes']:,} writes, {row['bytes']:,} B")
    for side in ("prefill", "decode"):
        nics = ", ".join(f"{n}={b:,}" for n, b in sorted(r["nic_bytes"][side].items()))
        lines.append(f"  bytes per NIC ({side}): {nics}")
    lines.append(f"  expected immediates at the decode node: {r['expected_immediates']:,} "
                 f"(per decode rank {r['expected_writes_per_decode_rank']} + 1 hidden state)")
    share = ", ".join(f"p{k}={v:.1%}" for k, v in r["prefill_rank_share"].items())
    lines.append(f"  over many requests, prefill rank shares of the bytes: {share}")
    lines.append(f"memory per rank (weights {r['weights_dtype']}, KV cache {r['kv_dtype']}):")
    for side in ("prefill", "decode"):
        m = r["memory"][side]
        w = "?" if m["weight_bytes_per_rank"] is None else _gib(m["weight_bytes_per_rank"])
        gpu = "" if m["gpu_memory_gib"] is None else f" on a {m['gpu_memory_gib']:g} GiB GPU"
        lines.append(f"  {side}: weights {w}, KV {m['kv_bytes_per_token_per_rank']:,} B/token{gpu}: {m['text']}")
    c = r.get("dp_vs_tp")
    if c is not None:
        n = c["dp"]
        lines.append(f"DP{n}-EP decode vs TP{n} decode on the same {n} GPUs:")
        lines.append(f"  wire bytes per request: DP {c['dp_wire_bytes']:,} vs TP {c['tp_wire_bytes']:,} "
                     f"({c['dp_wire_bytes'] / c['tp_wire_bytes']:.3f}x: one rank's copy instead of one per rank)")
        tw = "?" if c["tp_weight_bytes_per_rank"] is None else _gib(c["tp_weight_bytes_per_rank"])
        lines.append(f"  TP{n} per rank: weights {tw}: {c['tp_memory']['text']}")
        if c["node_kv_tokens_dp"] is not None and c["node_kv_tokens_tp"]:
            lines.append(f"  KV tokens per node: DP {c['node_kv_tokens_dp']:,} vs TP {c['node_kv_tokens_tp']:,} "
                         f"({c['node_kv_tokens_dp'] / c['node_kv_tokens_tp']:.1f}x: TP replicates the latent)")
    return "\n".join(lines)


def cmd_plan(args) -> int:
    from pdkv.topo import discover  # noqa: PLC0415

    dep = load_deployment(args.config)
    topo = discover(args.topo) if args.topo else discover("/")
    report = plan_request(dep, args.prompt_len, topo, args.request_id,
                          gpu_memory_gib=getattr(args, "gpu_memory_gib", None))
    print(json.dumps(report, indent=1) if args.json else render(report))
    return 0
