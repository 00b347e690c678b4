"""CUDA ordinals → PCI bus ids.

A process sees ``cuda:0..n-1``; which physical GPU each is depends on ``CUDA_VISIBLE_DEVICES``
(a list of indices or ``GPU-<uuid>`` prefixes) and ``CUDA_DEVICE_ORDER``. The messenger asks
for NICs by bus id, so an ordinal is translated once, here, and reordering the environment can
never move a GPU onto another GPU's NIC.

Rules followed (CUDA's documented behaviour):
- indices refer to the enumeration order; with ``CUDA_DEVICE_ORDER=PCI_BUS_ID`` that is PCI bus
  order, the same as nvidia-smi's index. The default (FASTEST_FIRST) only guarantees that order
  among identical GPUs, so a mixed host without PCI_BUS_ID gets a note;
- ``GPU-...`` entries match a UUID by unique prefix; ``MIG-...`` entries name MIG instances;
- enumeration stops at the first entry that is invalid (unknown index, ambiguous UUID, repeat);
- unset means every GPU; an empty value means none.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from pdkv.topo.model import Topology, TopologyError


@dataclass(frozen=True)
class CudaMapping:
    visible: str | None  # CUDA_VISIBLE_DEVICES as given; None when unset
    order: str  # CUDA_DEVICE_ORDER as given, "" when unset
    bus_ids: tuple[str, ...]  # bus_ids[i] is the GPU that is cuda:i in that environment
    notes: tuple[str, ...] = ()


def cuda_mapping(topology: Topology, env: dict[str, str] | None = None) -> CudaMapping:
    env = dict(os.environ) if env is None else env
    visible = env.get("CUDA_VISIBLE_DEVICES")
    order = env.get("CUDA_DEVICE_ORDER", "")
    gpus = list(topology.gpus)  # PCI bus order
    notes = []
    if order != "PCI_BUS_ID" and len({g.model for g in gpus}) > 1:
        notes.append("GPUs of different models and CUDA_DEVICE_ORDER is not PCI_BUS_ID: CUDA may "
                     "order them fastest first; set CUDA_DEVICE_ORDER=PCI_BUS_ID")
    if visible is None:
        return CudaMapping(None, order, tuple(g.bus_id for g in gpus), tuple(notes))
    out: list[str] = []
    for token in (t.strip() for t in visible.split(",")):
        bus, why = _match(token, gpus)
        if bus is not None and bus in out:
            bus, why = None, f"{token!r} repeats a GPU"
        if bus is None:
            if token:
                notes.append(f"CUDA_VISIBLE_DEVICES entry {why}: CUDA ignores it and every entry after it")
            break
        out.append(bus)
    return CudaMapping(visible, order, tuple(out), tuple(notes))


def _match(token: str, gpus) -> tuple[str | None, str]:
    if token.isdigit():
        i = int(token)
        if i < len(gpus):
            return gpus[i].bus_id, ""
        return None, f"{token!r} is not a GPU index (this host has {len(gpus)})"
    if token.startswith("MIG-"):
        return None, f"{token!r} is a MIG instance; pdkv places NICs per physical GPU"
    if token.startswith("GPU-"):
        hits = [g for g in gpus if g.uuid and g.uuid.startswith(token)]
        if len(hits) == 1:
            return hits[0].bus_id, ""
        return None, f"{token!r} matches {len(hits)} GPU UUIDs"
    return None, f"{token!r} is neither an index nor a GPU UUID"


def bus_id_for_ordinal(topology: Topology, ordinal: int, env: dict[str, str] | None = None) -> str:
    """The PCI bus id of ``cuda:<ordinal>`` under ``env`` (default: this process's environment)."""
    m = cuda_mapping(topology, env)
    if not 0 <= ordinal < len(m.bus_ids):
        raise TopologyError(f"cuda:{ordinal} does not exist: CUDA_VISIBLE_DEVICES={m.visible!r} "
                            f"makes {len(m.bus_ids)} GPU(s) visible ({', '.join(m.bus_ids) or 'none'})")
    return m.bus_ids[ordinal]


def torch_device_bus_id(ordinal: int) -> str:
    """Ask CUDA itself (through torch) for the bus id of ``cuda:<ordinal>`` in this process.

    This is the authoritative answer inside a running server; ``bus_id_for_ordinal`` is the
    same answer computed from the environment, for tools that must not initialise CUDA.
    """
    import torch  # noqa: PLC0415 - heavy, and only meaningful with CUDA

    if not torch.cuda.is_available():
        raise TopologyError("CUDA is not available in this process: no GPU bus id to ask for")
    if not 0 <= ordinal < torch.cuda.device_count():
        raise TopologyError(f"cuda:{ordinal} does not exist ({torch.cuda.device_count()} visible)")
    p = torch.cuda.get_device_properties(ordinal)
    if not hasattr(p, "pci_bus_id"):
        raise TopologyError("this torch build does not report PCI bus ids; pass the bus id explicitly")
    return f"{getattr(p, 'pci_domain_id', 0):04x}:{p.pci_bus_id:02x}:{p.pci_device_id:02x}.0"
