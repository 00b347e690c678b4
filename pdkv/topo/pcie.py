"""PCIe tree arithmetic: bus id spelling, device paths and how far apart two devices are.

Distances use the vocabulary of ``nvidia-smi topo -m`` because that is what users compare with:

    PIX   at most one PCIe switch between the two (both hang off the same switch)
    PXB   several PCIe bridges/switches, but not through the host bridge
    PHB   through a PCIe host bridge (the CPU's root complex)
    NODE  between host bridges of the same NUMA node
    SYS   across the interconnect between NUMA nodes (UPI, Infinity Fabric)

PIX and PXB are "under the same PCIe switch": GPU memory reaches the NIC peer-to-peer without
touching the CPU, which is what GPUDirect RDMA needs to run at line rate.
"""

from __future__ import annotations

import re

from pdkv.topo.model import PciDevice, TopologyError

BDF_RE = re.compile(r"^[0-9a-f]{4,8}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]$")
TIERS = ("PIX", "PXB", "PHB", "NODE", "SYS")


def is_bdf(name: str) -> bool:
    return bool(BDF_RE.match(name))


def normalize_bus_id(bus_id: str) -> str:
    """Spell a PCI bus id the way sysfs does: ``0000:1b:00.0``.

    Accepts nvidia-smi's 8-digit domain (``00000000:1B:00.0``), upper case, and a missing
    domain (``1b:00.0``, domain 0).
    """
    text = bus_id.strip().lower()
    m = re.match(r"^(?:([0-9a-f]{1,8}):)?([0-9a-f]{1,2}):([0-9a-f]{1,2})\.([0-7])$", text)
    if not m:
        raise TopologyError(
            f"{bus_id!r} is not a PCI bus id (expected DOMAIN:BUS:DEVICE.FUNCTION, e.g. 0000:1b:00.0)")
    domain, bus, dev, fn = m.groups()
    return f"{int(domain or '0', 16):04x}:{int(bus, 16):02x}:{int(dev, 16):02x}.{fn}"


def path_from_device_dir(parts: list[str]) -> tuple[str, ...]:
    """The PCIe path of a device from its resolved sysfs directory, split into components.

    ``devices/pci0000:15/0000:15:01.0/0000:16:00.0`` → ``("pci0000:15", "0000:15:01.0",
    "0000:16:00.0")``. Anything after the last bus id (``virtio2/net/eth0``, ``infiniband/mlx5_0``)
    is dropped, so the same function finds the PCI function behind an interface or RDMA device.
    Returns ``()`` when there is no PCI device on the way (virtual interfaces, soft RoCE).
    """
    start = next((i for i, p in enumerate(parts) if p.startswith("pci") and ":" in p), None)
    if start is None:
        return ()
    out = [parts[start]]
    for p in parts[start + 1:]:
        if not is_bdf(p):
            break
        out.append(p)
    return tuple(out) if len(out) > 1 else ()


def common_ancestors(a: PciDevice, b: PciDevice) -> tuple[str, ...]:
    """The shared prefix of the two devices' ancestor chains (host bridge first)."""
    out = []
    for x, y in zip(a.ancestors, b.ancestors):
        if x != y:
            break
        out.append(x)
    return tuple(out)


def distance(a: PciDevice, b: PciDevice, numa_a: int, numa_b: int) -> tuple[str, int]:
    """(tier, depth): how far apart two PCI devices are; depth breaks ties within a tier.

    depth is the number of shared ancestors: deeper means the paths split further from the CPU,
    so among NICs under the same switch complex the one with the deepest split is the nearest.
    """
    common = common_ancestors(a, b)
    if len(common) >= 2:  # a shared PCI bridge below the host bridge
        below = (len(a.ancestors) - len(common)) + (len(b.ancestors) - len(common))
        # NOTE: each device sits one downstream port below a shared switch → below == 2.
        return ("PIX" if below <= 2 else "PXB"), len(common)
    if len(common) == 1:
        return "PHB", 1
    if numa_a >= 0 and numa_a == numa_b:
        return "NODE", 0
    return "SYS", 0


def tier_rank(tier: str) -> int:
    return TIERS.index(tier)


def pci_kind(dev: PciDevice) -> str:
    """A short human name for the device's PCI class (enough to read a PCIe tree)."""
    c = dev.class_code[2:6] if dev.class_code.startswith("0x") else dev.class_code[:4]
    return {
        "0302": "GPU", "0300": "GPU", "0207": "InfiniBand", "0200": "Ethernet", "0280": "Network",
        "0604": "bridge", "0600": "host bridge", "0108": "NVMe", "0106": "SATA",
    }.get(c, f"class {c}")


KNOWN_DEVICES = {
    ("0x10de", "0x2330"): "NVIDIA H100 SXM5 80GB",
    ("0x10de", "0x2335"): "NVIDIA H200 SXM 141GB",
    ("0x10de", "0x20b2"): "NVIDIA A100 SXM4 80GB",
    ("0x15b3", "0x1021"): "ConnectX-7",
    ("0x15b3", "0x101d"): "ConnectX-6 Dx",
    ("0x15b3", "0x101b"): "ConnectX-6",
    ("0x15b3", "0x1017"): "ConnectX-5",
    ("0x15b3", "0xa2dc"): "BlueField-3",
    ("0x1d0f", "0xefa0"): "EFA",
    ("0x1d0f", "0xefa1"): "EFA",
    ("0x1d0f", "0xefa2"): "EFA",
    ("0x1d0f", "0xec20"): "ENA",
    ("0x1000", "0xc030"): "Broadcom PEX89xxx switch",
    ("0x8086", "0x1572"): "Intel X710",
    ("0x1af4", "0x1041"): "virtio-net",
}


def device_name(dev: PciDevice) -> str:
    return KNOWN_DEVICES.get((dev.vendor, dev.device), f"{dev.vendor[2:]}:{dev.device[2:]}")
