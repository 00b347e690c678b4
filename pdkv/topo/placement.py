"""Which NICs a GPU's transfers go through, and which CPUs run the messenger's poller thread.

Rules (the messenger's verbs transport applies them to its ``nics`` config):
- an explicit NIC list always wins; a name that does not exist is an error naming it and listing
  what does exist;
- ``["auto"]`` with a GPU picks the RDMA NICs nearest the GPU: under the same PCIe switch (the
  deepest shared switch when there are several levels), else on the same NUMA node, else anywhere
  (said in the reason); only devices with an ACTIVE port count. The poller gets the CPUs of the
  GPU's NUMA node;
- ``["auto"]`` without a GPU picks every RDMA device with an ACTIVE port on any node, and the
  poller gets the CPUs of those NICs' nodes;
- no RDMA device at all (or none ACTIVE) is a clear error: the verbs transport cannot run.
"""

from __future__ import annotations

from dataclasses import dataclass

from pdkv.topo.model import Gpu, RdmaDevice, Topology, TopologyError
from pdkv.topo.pcie import distance, tier_rank
from pdkv.topo.tree import format_cpulist


@dataclass(frozen=True)
class Placement:
    nics: list[str]  # ibverbs device names (auto), or the names given (explicit)
    cpus: list[int]  # CPUs the poller thread may run on (sched_setaffinity set)
    reason: str  # one line a human can check against `tools/topo`


def placement(topology: Topology, gpu_pci_bus_id: str | None = None,
              nics: list[str] | tuple[str, ...] | str = ("auto",)) -> Placement:
    names = [nics] if isinstance(nics, str) else list(nics)
    if not names:
        raise TopologyError("nics is empty: name at least one NIC, or use ['auto']")
    gpu = topology.gpu(gpu_pci_bus_id) if gpu_pci_bus_id else None
    if "auto" in names:
        if len(names) > 1:
            raise TopologyError(f"nics {names!r}: 'auto' cannot be mixed with NIC names")
        return _auto(topology, gpu)
    return _explicit(topology, gpu, names)


def nic_distance(topology: Topology, gpu: Gpu, nic: RdmaDevice) -> tuple[str, int]:
    """(tier, depth) between a GPU and an RDMA device; a NIC without PCI function is SYS."""
    if nic.pci is None:
        return "SYS", 0
    return distance(gpu.pci, nic.pci, topology.numa_of(gpu.pci), topology.numa_of(nic.pci))


def _gpu_cpus(topology: Topology, gpu: Gpu) -> list[int]:
    node = topology.numa_of(gpu.pci)
    cpus = topology.node_cpus(node) if node >= 0 else ()
    return list(cpus or gpu.pci.local_cpus or topology.online_cpus)


def _nodes_cpus(topology: Topology, nodes: set[int]) -> list[int]:
    cpus = sorted({c for n in nodes for c in topology.node_cpus(n)})
    return cpus or list(topology.online_cpus)


def _auto(topology: Topology, gpu: Gpu | None) -> Placement:
    if not topology.rdma:
        raise TopologyError(
            "nics: auto found no RDMA device (sys/class/infiniband is absent or empty): the verbs "
            "transport cannot run on this host; use transport: tcp, or check that the RDMA drivers "
            "are loaded")
    active = [d for d in topology.rdma if d.active]
    if not active:
        states = ", ".join(f"{d.name} port {p.num} {p.state}" for d in topology.rdma for p in d.ports)
        raise TopologyError(f"nics: auto found RDMA devices but no ACTIVE port ({states or 'no ports'})")
    inactive = [d for d in topology.rdma if not d.active]
    note = f"; skipped {', '.join(d.name for d in inactive)} (no ACTIVE port)" if inactive else ""
    if gpu is None:
        nodes = {topology.numa_of(d.pci) for d in active} - {-1}
        where = f"NUMA node(s) {', '.join(map(str, sorted(nodes)))}" if nodes else "unknown NUMA nodes"
        return Placement([d.name for d in active], _nodes_cpus(topology, nodes),
                         f"no GPU given: every RDMA device with an ACTIVE port, on any NUMA node "
                         f"({where}); poller on those nodes' CPUs{note}")
    def nearness(d: RdmaDevice) -> tuple[int, int]:  # smaller is nearer
        tier, depth = nic_distance(topology, gpu, d)
        return tier_rank(tier), -depth

    best = min(nearness(d) for d in active)
    chosen = [d for d in active if nearness(d) == best]
    tier = nic_distance(topology, gpu, chosen[0])[0]
    # Mention only the dead NICs that would have been at least as near as the chosen ones.
    near_dead = [d.name for d in inactive if nearness(d) <= best]
    note = f"; skipped {', '.join(near_dead)} (no ACTIVE port)" if near_dead else ""
    node = topology.numa_of(gpu.pci)
    cpus = _gpu_cpus(topology, gpu)
    node_text = f"NUMA node {node}" if node >= 0 else "unknown NUMA node"
    cpu_text = f"{node_text} CPUs" if node >= 0 else "the GPU's local CPUs"
    if tier in ("PIX", "PXB"):
        why = f"same PCIe switch as GPU {gpu.bus_id} ({tier})"
    elif tier in ("PHB", "NODE"):
        why = (f"no RDMA NIC under GPU {gpu.bus_id}'s PCIe switch: falling back to its {node_text} "
               f"({tier})")
    else:
        why = (f"no RDMA NIC under GPU {gpu.bus_id}'s PCIe switch or on its {node_text}: using NICs "
               f"on other nodes (SYS: traffic crosses the CPU interconnect)")
    return Placement([d.name for d in chosen], cpus,
                     f"{why}; poller on {cpu_text} {format_cpulist(cpus)}{note}")


def _explicit(topology: Topology, gpu: Gpu | None, names: list[str]) -> Placement:
    nets = {n.name: n for n in topology.net}
    missing, pcis, details = [], [], []
    for name in names:
        dev_name, _, port = name.partition(":")
        dev = topology.rdma_device(dev_name)
        if dev is not None:
            if port and not any(str(p.num) == port for p in dev.ports):
                missing.append(f"{name!r} (device {dev_name} has ports "
                               f"{', '.join(str(p.num) for p in dev.ports) or 'none'})")
                continue
            pci = dev.pci
        elif name in nets:
            pci = nets[name].pci
        else:
            missing.append(repr(name))
            continue
        pcis.append(pci)
        if gpu is not None:
            tier = nic_distance(topology, gpu, dev)[0] if dev is not None else (
                distance(gpu.pci, pci, topology.numa_of(gpu.pci), topology.numa_of(pci))[0]
                if pci is not None else "SYS")
            details.append(f"{name} {tier}")
    if missing:
        rdma = ", ".join(d.name for d in topology.rdma) or "none"
        net = ", ".join(n.name for n in topology.net) or "none"
        raise TopologyError(f"NIC {' and '.join(missing)} does not exist on this host; RDMA devices: "
                            f"{rdma}; network interfaces: {net}")
    nodes = {topology.numa_of(p) for p in pcis if p is not None} - {-1}
    if nodes:
        cpus = _nodes_cpus(topology, nodes)
    else:
        cpus = _gpu_cpus(topology, gpu) if gpu is not None else list(topology.online_cpus)
    reason = "explicit NIC list"
    if details:
        reason += f" (distance from GPU {gpu.bus_id}: {', '.join(details)})"
    reason += f"; poller on CPUs {format_cpulist(cpus)}"
    return Placement(list(names), cpus, reason)


def gpu_mapping(topology: Topology, nics=("auto",)) -> list[tuple[Gpu, Placement | None, str]]:
    """For every GPU: (gpu, placement or None, error text) as the messenger would compute it."""
    out = []
    for g in topology.gpus:
        try:
            out.append((g, placement(topology, g.bus_id, nics), ""))
        except TopologyError as e:
            out.append((g, None, str(e)))
    return out
