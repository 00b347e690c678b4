"""Discovery: sysfs (live or captured) → ``Topology``.

Reads only these places, which is also exactly what ``tools/topo capture`` saves:

    sys/devices/system/node/node<N>/{cpulist,meminfo}   NUMA nodes
    sys/devices/system/cpu/online
    sys/bus/pci/devices/<bdf> → sys/devices/pci<dom:bus>/.../<bdf>/{class,vendor,device,
        numa_node,local_cpulist,current_link_*,max_link_*,driver}
    sys/class/infiniband/<dev>/{device,node_guid,fw_ver,hca_type,ports/<n>/...}
    sys/class/net/<if>/{device,mtu,operstate,address,type,speed,dev_port}
    proc/driver/nvidia/gpus/<bdf>/information, nvidia-smi (see pdkv.topo.gpu)
"""

from __future__ import annotations

import dataclasses
import re

from pdkv.topo.gpu import find_gpus
from pdkv.topo.model import (Gid, NetInterface, NumaNode, PciDevice, RdmaDevice, RdmaPort,
                             Topology)
from pdkv.topo.pcie import path_from_device_dir
from pdkv.topo.tree import SysfsTree, parse_cpulist

PCI_ATTRS = ("class", "vendor", "device", "numa_node", "local_cpulist", "current_link_speed",
             "current_link_width", "max_link_speed", "max_link_width")


def discover(sysfs_root: str = "/") -> Topology:
    """Read the topology under ``sysfs_root`` ("/" = this machine; else a captured tree)."""
    tree = SysfsTree(sysfs_root)
    notes: list[str] = []
    numa = _numa_nodes(tree)
    online = parse_cpulist(tree.read("sys/devices/system/cpu/online"))
    if not online:
        online = tuple(sorted({c for n in numa for c in n.cpus}))
    if not numa:
        notes.append("no sys/devices/system/node: kernel without NUMA; all CPUs counted as node 0")
        numa = (NumaNode(0, online),)
    pci = _pci_devices(tree)
    if not pci:
        notes.append("no PCI devices under sys/bus/pci/devices")
    net = [_net_interface(tree, name, pci) for name in _natural(tree.listdir("sys/class/net"))]
    rdma = [_rdma_device(tree, name, pci, net)
            for name in _natural(tree.listdir("sys/class/infiniband"))]
    by_bdf = {d.pci.bdf: d.name for d in rdma if d.pci is not None}
    net = [dataclasses.replace(n, rdma=by_bdf.get(n.pci.bdf, "")) if n.pci else n for n in net]
    gpus, gpu_notes = find_gpus(tree, pci)
    notes.extend(gpu_notes)
    return Topology(sysfs_root=tree.root, numa_nodes=numa, online_cpus=online, pci=pci,
                    gpus=tuple(gpus), rdma=tuple(rdma), net=tuple(net), notes=tuple(notes))


def _natural(names: list[str]) -> list[str]:
    """mlx5_2 before mlx5_10, the order people count devices in."""
    return sorted(names, key=lambda s: [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", s)])


def _numa_nodes(tree: SysfsTree) -> tuple[NumaNode, ...]:
    nodes = []
    for name in tree.listdir("sys/devices/system/node"):
        if not (name.startswith("node") and name[4:].isdigit()):
            continue
        base = f"sys/devices/system/node/{name}"
        mem = None
        for line in (tree.read(f"{base}/meminfo") or "").splitlines():
            fields = line.split()  # "Node 0 MemTotal:  6121684 kB"
            if len(fields) >= 4 and fields[2] == "MemTotal:":
                mem = int(fields[3])
        nodes.append(NumaNode(int(name[4:]), parse_cpulist(tree.read(f"{base}/cpulist")), mem))
    return tuple(sorted(nodes, key=lambda n: n.id))


def _pci_devices(tree: SysfsTree) -> dict[str, PciDevice]:
    out = {}
    for bdf in tree.listdir("sys/bus/pci/devices"):
        rel = f"sys/bus/pci/devices/{bdf}"
        path = path_from_device_dir(tree.parts(rel))
        if not path or path[-1] != bdf:
            path = ("pci?", bdf)  # a link we cannot place in the tree: still list the device
        a = {k: tree.read(f"{rel}/{k}") or "" for k in PCI_ATTRS}
        numa = tree.read_int(f"{rel}/numa_node")
        out[bdf] = PciDevice(
            bdf=bdf, vendor=a["vendor"], device=a["device"], class_code=a["class"],
            numa_node=numa if numa is not None else -1,
            local_cpus=parse_cpulist(a["local_cpulist"]), path=path,
            driver=tree.link_name(f"{tree.resolve(rel)}/driver"),
            link_speed=a["current_link_speed"], link_width=a["current_link_width"],
            max_link_speed=a["max_link_speed"], max_link_width=a["max_link_width"])
    return out


def _pci_of(tree: SysfsTree, rel: str, pci: dict[str, PciDevice]) -> PciDevice | None:
    """The PCI function behind a class device (``sys/class/net/eth0``), via its resolved path."""
    if not tree.exists(f"{tree.resolve(rel)}/device"):
        return None
    path = path_from_device_dir(tree.parts(f"{rel}/device"))
    return pci.get(path[-1]) if path else None


def _net_interface(tree: SysfsTree, name: str, pci: dict[str, PciDevice]) -> NetInterface:
    rel = f"sys/class/net/{name}"
    speed = tree.read_int(f"{rel}/speed")
    return NetInterface(
        name=name, pci=_pci_of(tree, rel, pci), mtu=tree.read_int(f"{rel}/mtu"),
        operstate=tree.read(f"{rel}/operstate") or "unknown", address=tree.read(f"{rel}/address") or "",
        type=tree.read_int(f"{rel}/type"), speed_mbps=speed if speed and speed > 0 else None)


def _state(text: str | None) -> str:
    """``"4: ACTIVE"`` → ``"ACTIVE"``; ``"5: LinkUp"`` → ``"LinkUp"``."""
    return (text or "").split(":", 1)[-1].strip() or "unknown"


def _rdma_device(tree: SysfsTree, name: str, pci: dict[str, PciDevice],
                 net: list[NetInterface]) -> RdmaDevice:
    rel = f"sys/class/infiniband/{name}"
    dev_pci = _pci_of(tree, rel, pci)
    ports = []
    for p in tree.listdir(f"{rel}/ports"):
        if p.isdigit():
            ports.append(_rdma_port(tree, f"{rel}/ports/{p}", int(p), dev_pci, net))
    return RdmaDevice(name=name, pci=dev_pci, ports=tuple(sorted(ports, key=lambda p: p.num)),
                      node_guid=tree.read(f"{rel}/node_guid") or "",
                      fw_ver=tree.read(f"{rel}/fw_ver") or "", hca_type=tree.read(f"{rel}/hca_type") or "")


ZERO_GID = "0000:0000:0000:0000:0000:0000:0000:0000"


def _rdma_port(tree: SysfsTree, rel: str, num: int, dev_pci: PciDevice | None,
               net: list[NetInterface]) -> RdmaPort:
    gids = []
    for i in sorted((int(x) for x in tree.listdir(f"{rel}/gids") if x.isdigit())):
        gid = tree.read(f"{rel}/gids/{i}")
        if not gid or gid == ZERO_GID:
            continue  # an empty slot of the GID table
        gids.append(Gid(i, gid, tree.read(f"{rel}/gid_attrs/types/{i}") or "",
                        tree.read(f"{rel}/gid_attrs/ndevs/{i}") or ""))
    netdev = next((g.netdev for g in gids if g.netdev), "")
    if not netdev and dev_pci is not None:
        # IPoIB has no ndevs entry: the interface on the same PCI function, dev_port = port - 1.
        for n in net:
            if n.pci is not None and n.pci.bdf == dev_pci.bdf:
                if (tree.read_int(f"sys/class/net/{n.name}/dev_port") or 0) == num - 1:
                    netdev = n.name
                    break
    mtu = next((n.mtu for n in net if n.name == netdev), None)
    return RdmaPort(num=num, state=_state(tree.read(f"{rel}/state")),
                    phys_state=_state(tree.read(f"{rel}/phys_state")),
                    link_layer=tree.read(f"{rel}/link_layer") or "unknown",
                    rate=tree.read(f"{rel}/rate") or "", lid=tree.read(f"{rel}/lid") or "",
                    gids=tuple(gids), netdev=netdev, netdev_mtu=mtu)
