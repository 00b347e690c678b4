"""Architectures to compare, as files: which nodes, with which role configs, on which CPUs.

An architecture file (configs/ab/*.yaml) holds pdkv role-config sections shared by its nodes at
the top level, plus harness keys:

    kind: colocated | disagg
    prefill_nodes: 1        # disagg only (P of P:D)
    decode_nodes: 1         # disagg only (D of P:D); the harness spreads requests over them
    prefill: {...}          # disagg only: sections overriding the shared ones on prefill nodes
    decode: {...}           # disagg only: the same for decode nodes
    fork: false             # true: the nodes forked from one parent that imported torch and pdkv
                            # (pdkv/forkserver.py; its memory counts with the nodes')

``parallel.cpus`` left empty is filled from the hardware budget: a colocated node gets every CPU
of it; disaggregated prefill nodes get its first half and decode nodes the rest (the CPUs they
share if the budget has one). The budget is the same for every architecture of a run.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from pathlib import Path

from pdkv.config import ConfigError, _read_yaml

KINDS = ("colocated", "disagg")
CONFIG_DIR = Path(__file__).resolve().parents[3] / "configs" / "ab"
BUILTIN = ("colocated", "chunked", "disagg")
_HARNESS_KEYS = ("kind", "prefill_nodes", "decode_nodes", "prefill", "decode", "fork")


@dataclass(frozen=True)
class ArchSpec:
    name: str
    file: str
    kind: str
    shared: dict
    sections: dict = field(default_factory=dict)  # role -> override sections
    num_prefill: int = 0
    num_decode: int = 1  # colocated: the number of colocated nodes
    fork: bool = False  # the nodes forked from one parent (pdkv/forkserver.py)


@dataclass(frozen=True)
class NodeSpec:
    name: str  # e.g. disagg-prefill-0
    role: str  # colocated | prefill | decode
    config: dict  # the role config as YAML would hold it (ports filled in by the launcher)
    cpus: str


def load_arch(name: str, path: str | Path) -> ArchSpec:
    path = Path(path)
    data = _read_yaml(path)
    kind = data.get("kind")
    if kind not in KINDS:
        raise ConfigError(f"{path}: kind must be one of {', '.join(KINDS)}, got {kind!r}")
    sections = {r: data.get(r) or {} for r in ("prefill", "decode")}
    for r, sec in sections.items():
        if not isinstance(sec, dict):
            raise ConfigError(f"{path}: {r} must be a mapping of sections for the {r} nodes")
    np_, nd = data.get("prefill_nodes", 1), data.get("decode_nodes", 1)
    for key, v in (("prefill_nodes", np_), ("decode_nodes", nd)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ConfigError(f"{path}: {key} must be a positive integer, got {v!r}")
    shared = {k: v for k, v in data.items() if k not in _HARNESS_KEYS and k != "role"}
    fork = data.get("fork", False)
    if not isinstance(fork, bool):
        raise ConfigError(f"{path}: fork must be true or false (the nodes forked from one parent that imported "
                          f"torch and pdkv), got {fork!r}")
    if kind == "colocated":
        return ArchSpec(name, str(path), kind, shared, {}, 0, 1, fork)
    return ArchSpec(name, str(path), kind, shared, sections, np_, nd, fork)


def builtin(name: str) -> ArchSpec:
    return load_arch(name, CONFIG_DIR / f"{name}.yaml")


def with_pd(spec: ArchSpec, pd: str | None, transport: str | None) -> ArchSpec:
    """``--pd P:D`` and ``--transport`` applied to a disaggregated architecture."""
    if spec.kind != "disagg":
        return spec
    shared = copy.deepcopy(spec.shared)
    if transport:
        shared.setdefault("messenger", {})["transport"] = transport
    np_, nd = spec.num_prefill, spec.num_decode
    if pd:
        a, _, b = pd.partition(":")
        if not (a.isdigit() and b.isdigit() and int(a) > 0 and int(b) > 0):
            raise ConfigError(f"--pd must be P:D with positive counts (e.g. 1:1), got {pd!r}")
        np_, nd = int(a), int(b)
    return ArchSpec(spec.name, spec.file, spec.kind, shared, spec.sections, np_, nd, spec.fork)


def _merge(base: dict, over: dict) -> dict:
    out = copy.deepcopy(base)
    for k, v in (over or {}).items():
        out[k] = _merge(out.get(k) or {}, v) if isinstance(v, dict) else copy.deepcopy(v)
    return out


def _fmt(cpus: list[int]) -> str:
    return ",".join(str(c) for c in cpus)


def node_specs(spec: ArchSpec, budget: list[int]) -> list[NodeSpec]:
    """Every node of ``spec`` with its role config and CPUs (empty parallel.cpus -> from ``budget``)."""
    half = max(1, len(budget) // 2)
    split = {"colocated": budget, "prefill": budget[:half], "decode": budget[half:] or budget[:half]}
    roles = ([("colocated", spec.num_decode)] if spec.kind == "colocated"
             else [("prefill", spec.num_prefill), ("decode", spec.num_decode)])
    out = []
    for role, n in roles:
        d = _merge(spec.shared, spec.sections.get(role, {}))
        d["role"] = role
        par = d.setdefault("parallel", {})
        if not str(par.get("cpus") or "").strip():
            par["cpus"] = _fmt(split[role])
        for i in range(n):
            out.append(NodeSpec(f"{spec.name}-{role}-{i}", role, copy.deepcopy(d), str(par["cpus"])))
    return out
