"""HostWriter: writes a sysfs-like tree in `tools/topo capture` format (used by make_fixtures)."""

from __future__ import annotations

import os

from pdkv.topo.tree import LINK_MANIFEST, format_link_manifest, is_back_link


def ipv4_gid(a: str) -> str:
    o = [int(x) for x in a.split(".")]
    return f"0000:0000:0000:0000:0000:ffff:{o[0]:02x}{o[1]:02x}:{o[2]:02x}{o[3]:02x}"


class HostWriter:
    """Writes one sysfs-like tree; every path argument is relative to the tree root."""

    def __init__(self):
        # The tree is built in memory ({path: text}, {path: link target}) and written by save(),
        # so a test can compare it with the committed copy without writing anything.
        self.files: dict[str, str] = {}
        self.links: dict[str, str] = {}
        self.back_links: dict[str, str] = {}
        self.pci_paths: dict[str, str] = {}  # bdf → "sys/devices/pci..../.../bdf"

    def file(self, rel: str, text: str) -> None:
        self.files[rel] = f"{text}\n"

    def link(self, rel: str, target: str, as_written: str | None = None) -> None:
        """A relative symlink at rel pointing at the tree path target (like sysfs writes them;
        as_written: the kernel's own spelling, e.g. ``../../../0000:1a:00.0``); a link back up
        the tree goes to the capture's link manifest, as capture() does."""
        target = as_written or os.path.relpath(target, os.path.dirname(rel))
        if is_back_link(rel, target):
            self.back_links[rel] = target
            self.files[LINK_MANIFEST] = format_link_manifest(self.back_links)
        else:
            self.links[rel] = target

    def save(self, out: str) -> None:
        for rel, text in self.files.items():
            os.makedirs(os.path.dirname(os.path.join(out, rel)), exist_ok=True)
            with open(os.path.join(out, rel), "w") as f:
                f.write(text)
        for rel, target in self.links.items():
            os.makedirs(os.path.dirname(os.path.join(out, rel)), exist_ok=True)
            os.symlink(target, os.path.join(out, rel))

    def numa(self, node: int, cpulist: str, mem_kib: int) -> None:
        base = f"sys/devices/system/node/node{node}"
        self.file(f"{base}/cpulist", cpulist)
        self.file(f"{base}/meminfo", f"Node {node} MemTotal:       {mem_kib} kB\n"
                                     f"Node {node} MemFree:        {mem_kib * 9 // 10} kB")

    def pci(self, parent: str, bdf: str, cls: str, vendor: str, device: str, numa: int, cpus: str,
            driver: str | None = None, link: tuple[str, str] | None = None) -> str:
        """A PCI function under parent (a bdf, or a host bridge "pci0000:15")."""
        path = f"{self.pci_paths[parent] if parent in self.pci_paths else 'sys/devices/' + parent}/{bdf}"
        self.pci_paths[bdf] = path
        for k, v in (("class", cls), ("vendor", vendor), ("device", device), ("numa_node", numa),
                     ("local_cpulist", cpus)):
            self.file(f"{path}/{k}", v)
        if link is not None:
            for k in ("current", "max"):
                self.file(f"{path}/{k}_link_speed", link[0])
                self.file(f"{path}/{k}_link_width", link[1])
        if driver:
            self.link(f"{path}/driver", f"sys/bus/pci/drivers/{driver}")
        self.link(f"sys/bus/pci/devices/{bdf}", path)
        return bdf

    def rdma(self, name: str, bdf: str, hca: str, guid: str, ports: list[dict]) -> None:
        d = f"{self.pci_paths[bdf]}/infiniband/{name}"
        self.link(f"sys/class/infiniband/{name}", d)
        self.link(f"{d}/device", self.pci_paths[bdf], f"../../../{bdf}")
        for k, v in (("node_guid", guid), ("fw_ver", "28.39.1002" if hca.startswith("MT") else ""),
                     ("hca_type", hca), ("node_type", "1: CA")):
            if v:
                self.file(f"{d}/{k}", v)
        for num, p in enumerate(ports, start=1):
            pd = f"{d}/ports/{num}"
            for k in ("state", "phys_state", "link_layer", "rate", "lid", "sm_lid"):
                if k in p:
                    self.file(f"{pd}/{k}", p[k])
            for i, (gid, typ, ndev) in enumerate(p.get("gids", [])):
                self.file(f"{pd}/gids/{i}", gid)
                if typ:
                    self.file(f"{pd}/gid_attrs/types/{i}", typ)
                if ndev:
                    self.file(f"{pd}/gid_attrs/ndevs/{i}", ndev)

    def net(self, name: str, bdf: str | None, mtu: int, state: str, addr: str, typ: int = 1,
            speed: int | None = None, dev_port: int = 0) -> None:
        d = f"{self.pci_paths[bdf]}/net/{name}" if bdf else f"sys/devices/virtual/net/{name}"
        self.link(f"sys/class/net/{name}", d)
        if bdf:
            self.link(f"{d}/device", self.pci_paths[bdf], f"../../../{bdf}")
        for k, v in (("mtu", mtu), ("operstate", state), ("address", addr), ("type", typ),
                     ("dev_port", dev_port), ("dev_id", "0x0")):
            self.file(f"{d}/{k}", v)
        if speed is not None:
            self.file(f"{d}/speed", speed)

    def nvidia_gpu(self, bdf: str, model: str, uuid: str, minor: int) -> None:
        self.file(f"proc/driver/nvidia/gpus/{bdf}/information", "\n".join([
            f"Model: \t\t {model}", f"IRQ:   \t\t {300 + minor}", f"GPU UUID: \t {uuid}",
            "Video BIOS: \t 96.00.74.00.0d", "Bus Type: \t PCIe", "DMA Size: \t 52 bits",
            "DMA Mask: \t 0xfffffffffffff", f"Bus Location: \t {bdf}", f"Device Minor: \t {minor}",
            "GPU Excluded:\t No"]))

    def capture_info(self, host: str, kernel: str) -> None:
        self.file("pdkv-capture/CAPTURE.txt", "\n".join([
            "captured_at: (synthesized by tests/topo/make_fixtures.py)", f"hostname: {host}",
            f"kernel: {kernel}", "CUDA_VISIBLE_DEVICES: (unset)", "CUDA_DEVICE_ORDER: (unset)",
            "read back with: tools/topo --sysfs <this directory>"]))


BRIDGE = "0x060400"
GEN5 = ("32.0 GT/s PCIe", "16")
GEN4 = ("16.0 GT/s PCIe", "16")


def _board(w: HostWriter, root: str, rp: str, numa: int, cpus: str) -> None:
    """A root complex with one root port (Intel VT-d unit at :00.0, like Sapphire Rapids)."""
    bus = root[-2:]
    w.pci(root, f"0000:{bus}:00.0", "0x088000", "0x8086", "0x09a2", numa, cpus)
    w.pci(root, rp, BRIDGE, "0x8086", "0x352a", numa, cpus, driver="pcieport", link=GEN5)
