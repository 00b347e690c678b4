"""Topology → a JSON-ready dict (``tools/topo --json``) and a readable report (the default)."""

from __future__ import annotations

from pdkv.topo.checks import warnings
from pdkv.topo.cuda import cuda_mapping
from pdkv.topo.model import PciDevice, Topology, TopologyError
from pdkv.topo.pcie import device_name, pci_kind
from pdkv.topo.placement import nic_distance, placement
from pdkv.topo.tree import format_cpulist


def headline(topology: Topology) -> list[str]:
    """Plain sentences for what is missing: no GPU, no RDMA."""
    out = []
    if not topology.gpus:
        out.append("No GPU found (no NVIDIA device on the PCI bus): pdkv runs models on the CPU here.")
    if not topology.rdma:
        out.append("No RDMA device found (sys/class/infiniband is absent or empty): the verbs "
                   "transport cannot run here; use transport: tcp.")
    return out


def placements(topology: Topology, nics=("auto",), gpu: str | None = None) -> list[dict]:
    """One entry per GPU (or one for "no GPU"), as the messenger would place it."""
    cuda = cuda_mapping(topology)
    targets = [topology.gpu(gpu)] if gpu else list(topology.gpus) or [None]
    out = []
    for g in targets:
        entry = {"gpu": g.bus_id if g else None,
                 "cuda_ordinal": cuda.bus_ids.index(g.bus_id) if g and g.bus_id in cuda.bus_ids else None,
                 "nics": [], "distance": {}, "cpus": "", "reason": "", "error": ""}
        try:
            p = placement(topology, g.bus_id if g else None, nics)
        except TopologyError as e:
            entry["error"] = str(e)
        else:
            entry.update(nics=p.nics, cpus=format_cpulist(p.cpus), reason=p.reason)
            if g is not None:
                for name in p.nics:
                    dev = topology.rdma_device(name.partition(":")[0])
                    if dev is not None:
                        entry["distance"][name] = nic_distance(topology, g, dev)[0]
        out.append(entry)
    return out


def _pci(dev: PciDevice | None, topology: Topology) -> dict | None:
    if dev is None:
        return None
    return {"bdf": dev.bdf, "name": device_name(dev), "kind": pci_kind(dev), "driver": dev.driver,
            "numa_node": topology.numa_of(dev), "local_cpus": format_cpulist(dev.local_cpus),
            "pcie_path": list(dev.path), "link": _link(dev)}


def _link(dev: PciDevice) -> str:
    if not dev.link_speed:
        return ""
    return f"{dev.link_speed} x{dev.link_width} (max {dev.max_link_speed} x{dev.max_link_width})"


def to_dict(topology: Topology, nics=("auto",), gpu: str | None = None) -> dict:
    cuda = cuda_mapping(topology)
    return {
        "sysfs_root": topology.sysfs_root,
        "summary": headline(topology),
        "numa_nodes": [{"id": n.id, "cpus": format_cpulist(n.cpus), "num_cpus": len(n.cpus),
                        "mem_total_kib": n.mem_total_kib} for n in topology.numa_nodes],
        "online_cpus": format_cpulist(topology.online_cpus),
        "gpus": [{"bus_id": g.bus_id, "model": g.model, "uuid": g.uuid, "source": g.source,
                  "pci": _pci(g.pci, topology)} for g in topology.gpus],
        "cuda": {"CUDA_VISIBLE_DEVICES": cuda.visible, "CUDA_DEVICE_ORDER": cuda.order,
                 "ordinals": {str(i): b for i, b in enumerate(cuda.bus_ids)}, "notes": list(cuda.notes)},
        "rdma_devices": [{
            "name": d.name, "hca_type": d.hca_type, "fw_ver": d.fw_ver, "node_guid": d.node_guid,
            "pci": _pci(d.pci, topology),
            "ports": [{"num": p.num, "state": p.state, "phys_state": p.phys_state,
                       "link_layer": p.link_layer, "rate": p.rate, "lid": p.lid, "netdev": p.netdev,
                       "netdev_mtu": p.netdev_mtu, "roce_mtu": p.roce_mtu,
                       "suggested_gid_index": p.suggested_gid_index,
                       "gids": [{"index": x.index, "gid": x.gid, "type": x.type, "netdev": x.netdev}
                                for x in p.gids]} for p in d.ports]} for d in topology.rdma],
        "net_interfaces": [{"name": n.name, "virtual": n.pci is None, "pci": _pci(n.pci, topology),
                            "mtu": n.mtu, "operstate": n.operstate, "address": n.address,
                            "type": n.type, "speed_mbps": n.speed_mbps, "rdma": n.rdma}
                           for n in topology.net],
        "placement": placements(topology, nics, gpu),
        "warnings": warnings(topology),
        "notes": list(topology.notes),
    }


def _tree_lines(topology: Topology) -> tuple[list[str], int]:
    """The PCIe tree limited to GPUs, NICs and the bridges above them; (lines, hidden count)."""
    labels: dict[str, str] = {}
    for i, g in enumerate(topology.gpus):
        labels[g.bus_id] = f"GPU{i} {g.model or device_name(g.pci)}"
    for d in topology.rdma:
        if d.pci is not None:
            labels[d.pci.bdf] = f"{d.name} {device_name(d.pci)}"
    for n in topology.net:
        if n.pci is not None:
            labels[n.pci.bdf] = (labels.get(n.pci.bdf, device_name(n.pci)) + f" {n.name}")
    shown: set[str] = set()
    for bdf in labels:
        shown.update(topology.pci[bdf].path)
    lines = []
    last: tuple[str, ...] = ()
    for dev in sorted((topology.pci[b] for b in labels), key=lambda d: d.path):
        path = dev.path
        common = next((i for i, (a, b) in enumerate(zip(path, last)) if a != b), min(len(path), len(last)))
        for depth in range(common, len(path)):
            node = path[depth]
            pdev = topology.pci.get(node)
            if depth == 0:
                text = node
            elif node == dev.bdf:
                numa = topology.numa_of(dev)
                text = f"{node} {labels[node]}" + (f"  [NUMA {numa}]" if numa >= 0 else "")
            else:
                kind = pci_kind(pdev) if pdev else "?"
                text = f"{node} {'root port' if depth == 1 and kind == 'bridge' else kind}"
                if pdev and device_name(pdev) in ("Broadcom PEX89xxx switch",):
                    text += f" ({device_name(pdev)})"
            lines.append("  " * depth + text)
        last = path
    hidden = len([b for b in topology.pci if b not in shown])
    return lines, hidden
