"""What a role config needs of this host's NICs, and the check ``pdkv serve`` runs before the
weights load.

The NICs are the ones the node's messenger will open (pdkv.messenger.plan_placement, as
pdkv/disagg/node.py calls it); the host memory is what the node registers with them: its KV
cache when the model runs on the CPU (the size the engine will give it, from kv_cache and the
model's config.json, every TP rank's), the staging ring when GPU KV is staged through host
memory. GPU KV without staging (messenger.staging off) needs GPUDirect RDMA on those NICs.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from pdkv import transports
from pdkv.config import Config

ROLES_WITH_MESSENGER = ("prefill", "decode")


@dataclass(frozen=True)
class ConfigNeeds:
    nics: tuple[str, ...]
    host_bytes: int
    what: str  # "the KV cache", "the staging ring"
    gpu_ordinal: int | None  # the GPU whose memory the NICs must reach, None: CPU serving
    gpudirect_required: bool
    reason: str  # why these NICs (the placement's words)


def uses_verbs(cfg: Config) -> bool:
    # the probe opens ibverbs devices: only a transport that drives them needs it
    return cfg.role in ROLES_WITH_MESSENGER and transports.options_class(cfg.messenger.transport).probe_rdma


def kv_cache_bytes(cfg: Config) -> int:
    """Bytes of KV cache the engine will make for ``cfg`` on the CPU, summed over TP ranks
    (pdkv.engine.factory.build_parts: each rank's page bytes x the same number of pages)."""
    import torch  # noqa: PLC0415

    from pdkv.models.config import parse_arch_config  # noqa: PLC0415
    from pdkv.models.kv_layout import kv_layout  # noqa: PLC0415
    from pdkv.models.loader import read_json, resolve_dtype  # noqa: PLC0415
    from pdkv.models.parallel import TPLayout  # noqa: PLC0415
    from pdkv.engine.factory import num_pages_for  # noqa: PLC0415

    path = cfg.model.path
    if not path:
        from pdkv.default_model import ensure_default_model  # noqa: PLC0415

        path = str(ensure_default_model())
    hf = read_json(Path(path) / "config.json")
    arch = parse_arch_config(hf, str(Path(path) / "config.json"))
    dtype = resolve_dtype(cfg.model.dtype, hf)
    tp = cfg.parallel.tp
    ranks = [TPLayout(r, tp, arch).local_arch() for r in range(tp)] if tp > 1 else [arch]
    page = [kv_layout(a).page_bytes(cfg.kv_cache.page_size, dtype) * arch.num_layers for a in ranks]
    max_len = cfg.model.max_model_len or arch.max_position_embeddings
    useful = cfg.scheduler.max_num_seqs * -(-max_len // cfg.kv_cache.page_size)
    pages = num_pages_for(cfg.kv_cache, page[0], torch.device("cpu"), useful)
    return sum(p * pages for p in page)


def config_needs(cfg: Config, sysfs_root: str = "/") -> ConfigNeeds:
    """ValueError (ConfigError, TopologyError) naming what is wrong with the config."""
    from pdkv.messenger import plan_placement  # noqa: PLC0415

    if not uses_verbs(cfg):
        raise ValueError(f"{cfg.source}: role {cfg.role} with messenger.transport {cfg.messenger.transport} "
                         "opens no RDMA NIC (only prefill/decode roles on transport verbs do)")
    where = plan_placement(cfg.messenger, sysfs_root=sysfs_root, num_ranks=cfg.parallel.tp)
    device = cfg.model.device
    if device == "cpu":
        return ConfigNeeds(where.nics, kv_cache_bytes(cfg), "the KV cache", None, False, where.reason)
    ordinal = int(device.split(":", 1)[1]) if ":" in device else 0
    staged = cfg.messenger.staging != "off"
    ring = int(cfg.messenger.staging_mib * (1 << 20)) if staged else 0
    return ConfigNeeds(where.nics, ring, "the staging ring", ordinal, not staged, where.reason)


def serve_check(cfg: Config, backend: str = "auto", timeout_s: float = 600.0) -> str | None:
    """None when every NIC the node will open passes the probe (or it opens none), else the
    message ``pdkv serve`` refuses to start with: each failing NIC, what is missing, the fix.
    The probe runs in a child process (``python -m pdkv.probe``), never in the server."""
    from pdkv.topo import TopologyError  # noqa: PLC0415

    if not uses_verbs(cfg):
        return None
    try:
        needs = config_needs(cfg)
    except TopologyError as e:
        return f"{cfg.source}: messenger.nics: {e}"
    request = {"nics": list(needs.nics), "host_bytes": needs.host_bytes, "what": needs.what,
               "backend": backend, "gpu_ordinal": needs.gpu_ordinal,
               "gpudirect_required": needs.gpudirect_required}
    root = str(Path(__file__).resolve().parents[2])  # the child imports this same pdkv
    path = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "PYTHONPATH": path}
    try:
        proc = subprocess.run([sys.executable, "-m", "pdkv.probe"], input=json.dumps(request), text=True,
                              capture_output=True, timeout=timeout_s, env=env)
        result = json.loads(proc.stdout.strip().splitlines()[-1])
    except subprocess.TimeoutExpired:
        return f"{cfg.source}: the RDMA probe of {', '.join(needs.nics)} did not finish in {timeout_s:g} s"
    except (ValueError, IndexError):
        return (f"{cfg.source}: the RDMA probe of {', '.join(needs.nics)} failed (exit status "
                f"{proc.returncode}): {proc.stderr.strip()[-2000:]}")
    if result["ok"]:
        return None
    return (f"{cfg.source}: messenger.transport verbs cannot use this host's NICs: "
            + " | ".join(result["failures"]) + f" (details: tools/topo --probe -c {cfg.source})")
