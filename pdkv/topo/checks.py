"""Warnings about the mistakes that break RDMA transfer engines in the field.

Most of them are pairing and addressing mistakes, not bugs: a GPU with no NIC under its switch,
a RoCE interface left at MTU 1500, a RoCE port without a routable (RoCE v2, non-link-local) GID,
a port that is not ACTIVE, a link that trained at a lower speed or width than the card supports.
"""

from __future__ import annotations

from pdkv.topo.model import Topology
from pdkv.topo.placement import gpu_mapping, nic_distance


def warnings(topology: Topology) -> list[str]:
    out: list[str] = []
    for d in topology.rdma:
        for p in d.ports:
            where = f"{d.name} port {p.num}"
            if not p.active:
                out.append(f"{where} is {p.state} ({p.phys_state}): it carries no traffic")
                continue
            if p.link_layer == "Ethernet":
                mtu = p.roce_mtu
                if mtu is not None and mtu < 4096:
                    out.append(f"{where}: interface {p.netdev} has MTU {p.netdev_mtu}, so RoCE runs "
                               f"at path MTU {mtu}; set the interface MTU to 4200 or more (9000 is usual)")
                if not any(g.type == "RoCE v2" and not g.link_local for g in p.gids):
                    out.append(f"{where}: no routable RoCE v2 GID (only link-local ones): give "
                               f"{p.netdev or 'its interface'} an IP address")
    for dev in sorted(topology.pci.values(), key=lambda x: x.bdf):
        interesting = dev.vendor == "0x10de" or any(
            d.pci is not None and d.pci.bdf == dev.bdf for d in topology.rdma)
        if interesting and dev.link_degraded:
            out.append(f"{dev.bdf}: PCIe link at {dev.link_speed} x{dev.link_width}, but the device "
                       f"supports {dev.max_link_speed} x{dev.max_link_width}")
    if len(topology.numa_nodes) > 1:
        unknown = [g.bus_id for g in topology.gpus if g.pci.numa_node < 0]
        unknown += [d.name for d in topology.rdma if d.pci is not None and d.pci.numa_node < 0]
        if unknown:
            out.append(f"NUMA node unknown (numa_node = -1) on a {len(topology.numa_nodes)}-node "
                       f"host for {', '.join(unknown)}: CPU pinning falls back to local_cpulist")
    if topology.rdma:
        for g, plc, err in gpu_mapping(topology):
            if plc is None:
                continue
            tier = nic_distance(topology, g, topology.rdma_device(plc.nics[0]))[0]
            if tier not in ("PIX", "PXB"):
                out.append(f"GPU {g.bus_id} has no RDMA NIC under its PCIe switch (nearest: {tier}): "
                           f"GPUDirect RDMA goes through the CPU")
    return out
