"""What topology discovery finds: plain frozen dataclasses, no I/O.

Every device is named the way the hardware and the kernel name it: GPUs and NICs by PCI bus id
(``0000:1b:00.0``, lower case, 4-digit domain), RDMA devices by their ibverbs name (``mlx5_0``),
network interfaces by their kernel name. GPUs are never identified by CUDA ordinal: ordinals
depend on ``CUDA_VISIBLE_DEVICES`` and ``CUDA_DEVICE_ORDER`` (see ``pdkv.topo.cuda``).
"""

from __future__ import annotations

from dataclasses import dataclass, field


class TopologyError(ValueError):
    """Bad input or an impossible request: names what was wrong and what exists instead."""


@dataclass(frozen=True)
class PciDevice:
    bdf: str  # "0000:1b:00.0"
    vendor: str  # "0x10de"
    device: str  # "0x2330"
    class_code: str  # "0x030200": base class 03 (display), subclass 02 (3D controller)
    numa_node: int  # -1: the firmware did not say (common in VMs)
    local_cpus: tuple[int, ...]
    # From the host bridge down: ("pci0000:15", "0000:15:01.0", ..., bdf). The bridges between
    # the host bridge and the device are the PCIe tree; two devices under the same PCIe switch
    # share a prefix longer than the host bridge alone.
    path: tuple[str, ...]
    driver: str | None = None
    link_speed: str = ""  # current_link_speed, e.g. "32.0 GT/s PCIe"
    link_width: str = ""  # current_link_width, e.g. "16"
    max_link_speed: str = ""
    max_link_width: str = ""

    @property
    def ancestors(self) -> tuple[str, ...]:
        """Host bridge then PCI bridges above this device (its path without itself)."""
        return self.path[:-1]

    @property
    def link_degraded(self) -> bool:
        """True when the link trained slower or narrower than the device can run."""
        if not (self.link_speed and self.max_link_speed and self.link_width and self.max_link_width):
            return False
        return (_speed(self.link_speed) < _speed(self.max_link_speed)
                or _int(self.link_width) < _int(self.max_link_width))


def _speed(text: str) -> float:
    try:
        return float(text.split()[0])
    except (ValueError, IndexError):
        return 0.0


def _int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        return 0


@dataclass(frozen=True)
class NumaNode:
    id: int
    cpus: tuple[int, ...]
    mem_total_kib: int | None = None


@dataclass(frozen=True)
class Gpu:
    bus_id: str  # PCI bus id, the GPU's only identity here
    pci: PciDevice
    model: str = ""  # "NVIDIA H100 80GB HBM3" (driver), or "" when only PCI says it is a GPU
    uuid: str = ""  # "GPU-..." (driver); CUDA_VISIBLE_DEVICES may name GPUs by UUID
    source: str = "pci"  # where model/uuid came from: "nvidia-smi", "/proc/driver/nvidia", "pci"


@dataclass(frozen=True)
class Gid:
    index: int
    gid: str  # "fe80:0000:0000:0000:0a4e:2bff:fe11:0001"
    type: str = ""  # "IB/RoCE v1" or "RoCE v2"; "" when the kernel does not say (IB, EFA)
    netdev: str = ""  # RoCE: the interface this GID belongs to

    @property
    def link_local(self) -> bool:
        return self.gid.startswith("fe80:")


@dataclass(frozen=True)
class RdmaPort:
    num: int
    state: str  # "ACTIVE", "DOWN", "INIT", ... (the text after "4: ")
    phys_state: str  # "LinkUp", "Disabled", ...
    link_layer: str  # "InfiniBand", "Ethernet" (RoCE), "Unspecified" (EFA)
    rate: str  # "400 Gb/sec (4X NDR)"
    lid: str = ""
    gids: tuple[Gid, ...] = ()
    netdev: str = ""  # RoCE / IPoIB interface of this port, if any
    netdev_mtu: int | None = None

    @property
    def active(self) -> bool:
        return self.state == "ACTIVE"

    @property
    def suggested_gid_index(self) -> int | None:
        """The GID index a RoCE connection should use: a RoCE v2 GID with an IPv4 address, else
        any routable RoCE v2 GID; None when there is none (the port needs an IP address).
        InfiniBand (and EFA) use GID 0, the port's link-local GID.
        """
        if self.link_layer != "Ethernet":
            return self.gids[0].index if self.gids else None
        v2 = [g for g in self.gids if g.type == "RoCE v2" and not g.link_local]
        ipv4 = [g for g in v2 if g.gid.startswith("0000:0000:0000:0000:0000:ffff:")]
        return (ipv4 or v2)[0].index if (ipv4 or v2) else None

    @property
    def roce_mtu(self) -> int | None:
        """The RDMA path MTU RoCE will use, derived from the interface MTU like the kernel does.

        ``iboe_get_mtu`` subtracts the RoCE v2 headers (GRH 40 + UDP 8 + BTH 12 + XRC 4 +
        AtomicETH 28 + ICRC 4 = 96 bytes) and rounds down to an IB MTU, so an interface MTU of
        1500 gives 1024 and at least 4192 is needed for 4096.
        """
        if self.link_layer != "Ethernet" or self.netdev_mtu is None:
            return None
        payload = self.netdev_mtu - 96
        for mtu in (4096, 2048, 1024, 512, 256):
            if payload >= mtu:
                return mtu
        return None


@dataclass(frozen=True)
class RdmaDevice:
    name: str  # ibverbs name: "mlx5_0", "rdmap79s0" (EFA), "rxe0" (soft RoCE, no PCI device)
    pci: PciDevice | None
    ports: tuple[RdmaPort, ...]
    node_guid: str = ""
    fw_ver: str = ""
    hca_type: str = ""  # "MT4129" (ConnectX-7), "efa" ...

    @property
    def active(self) -> bool:
        return any(p.active for p in self.ports)


@dataclass(frozen=True)
class NetInterface:
    name: str
    pci: PciDevice | None  # None: virtual (lo, docker0, veth, bridges)
    mtu: int | None
    operstate: str  # "up", "down", "unknown"
    address: str  # MAC (or 20-byte IPoIB hardware address)
    type: int | None = None  # ARPHRD: 1 Ethernet, 32 InfiniBand (IPoIB), 772 loopback
    speed_mbps: int | None = None  # None when the kernel cannot say (link down, virtual)
    rdma: str = ""  # the RDMA device sharing this interface's PCI function, if any


@dataclass(frozen=True)
class Topology:
    sysfs_root: str
    numa_nodes: tuple[NumaNode, ...]
    online_cpus: tuple[int, ...]
    pci: dict[str, PciDevice]  # every PCI device, by bus id
    gpus: tuple[Gpu, ...]  # in PCI bus order (nvidia-smi index order)
    rdma: tuple[RdmaDevice, ...]
    net: tuple[NetInterface, ...]
    notes: tuple[str, ...] = field(default=())  # what could not be read, and why

    def numa_of(self, dev: PciDevice | None) -> int:
        """The device's NUMA node; -1 unknown. A single-node host puts everything on node 0."""
        if dev is not None and dev.numa_node >= 0:
            return dev.numa_node
        if len(self.numa_nodes) == 1:
            return self.numa_nodes[0].id
        return -1

    def node_cpus(self, node: int) -> tuple[int, ...]:
        for n in self.numa_nodes:
            if n.id == node:
                return n.cpus
        return ()

    def gpu(self, bus_id: str) -> Gpu:
        from pdkv.topo.pcie import normalize_bus_id

        want = normalize_bus_id(bus_id)
        for g in self.gpus:
            if g.bus_id == want:
                return g
        have = ", ".join(g.bus_id for g in self.gpus) or "none"
        raise TopologyError(f"no GPU at PCI bus id {bus_id!r}; GPUs on this host: {have}")

    def rdma_device(self, name: str) -> RdmaDevice | None:
        return next((d for d in self.rdma if d.name == name), None)
