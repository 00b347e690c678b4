"""Writes the committed topology fixtures under tests/topo/fixtures/ in `tools/topo capture` format.

    .venv/bin/python tests/topo/make_fixtures.py [NAME...]     # rewrite fixtures

No DGX H100 or AWS p5 is reachable from this project's machines, so these trees are built from
the layouts such hosts show (nvidia-smi topo -m, lspci -tv, ibv_devinfo) rather than captured.
They hold exactly the files and relative symlinks a capture holds (test_capture.py checks that
capturing a fixture reproduces it byte for byte); `live-vm/` is a real capture of the CI VM.

- dgx-h100: 2 NUMA nodes, 8 H100 in four PCIe switch complexes (two GPU+ConnectX-7 pairs each,
  every pair behind its own second-level switch), 8 InfiniBand NDR ports mlx5_0-3,6-9; two
  dual-port ConnectX-7 for storage on RoCE (mlx5_4/5, mlx5_10/11; one at MTU 1500 without an IP,
  one port down), an Intel X710 and the BMC's ASPEED VGA (not a GPU).
- aws-p5: 2 NUMA nodes, 8 H100, each behind a switch with 4 EFA devices and an NVMe (32 EFA).
- no-accel: a 2-socket server without GPU or RDMA: X710, NVMe, ASPEED VGA, docker0.
"""

from __future__ import annotations

import os
import shutil
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from topo_sysfs_writer import BRIDGE, GEN4, GEN5, HostWriter, _board, ipv4_gid  # noqa: E402

FIXTURES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures")
H100 = "NVIDIA H100 80GB HBM3"
IB = {"state": "4: ACTIVE", "phys_state": "5: LinkUp", "link_layer": "InfiniBand",
      "rate": "400 Gb/sec (4X NDR)", "sm_lid": "0x1"}


def _guid(n: int) -> str:
    return f"a088:c203:00{n:02x}:9e{n:02x}"


def _uuid(host: int, n: int) -> str:
    return f"GPU-{host:02x}{n:02x}c0de-5a1e-4b7d-9c3e-7f00000000{n:02x}"


def dgx_h100(w: HostWriter) -> None:
    nodes = {0: "0-55,112-167", 1: "56-111,168-223"}
    for n, cpus in nodes.items():
        w.numa(n, cpus, 1056700000)
    w.file("sys/devices/system/cpu/online", "0-223")
    # Chipset root complex: management NIC and the BMC's VGA.
    w.pci("pci0000:00", "0000:00:00.0", "0x060000", "0x8086", "0x09a2", 0, nodes[0])
    w.pci("pci0000:00", "0000:00:1c.0", BRIDGE, "0x8086", "0x1bb8", 0, nodes[0], "pcieport", GEN4)
    for fn, name, state, speed in ((0, "eno1", "up", 10000), (1, "eno2", "down", None)):
        w.pci("0000:00:1c.0", f"0000:01:00.{fn}", "0x020000", "0x8086", "0x1572", 0, nodes[0],
              "i40e", ("8.0 GT/s PCIe", "8"))
        w.net(name, f"0000:01:00.{fn}", 1500, state, f"7c:c2:55:12:34:{fn:02x}", speed=speed)
    w.pci("pci0000:00", "0000:00:1c.4", BRIDGE, "0x8086", "0x1bbc", 0, nodes[0], "pcieport")
    w.pci("0000:00:1c.4", "0000:02:00.0", BRIDGE, "0x1a03", "0x1150", 0, nodes[0])
    w.pci("0000:02:00.0", "0000:03:00.0", "0x030000", "0x1a03", "0x2000", 0, nodes[0], "ast")
    names = iter(f"mlx5_{i}" for i in range(12))
    gpu = 0
    for base, numa in ((0x15, 0), (0x37, 0), (0x5a, 0), (0x97, 1), (0xb9, 1), (0xd8, 1)):
        root, rp = f"pci0000:{base:02x}", f"0000:{base:02x}:01.0"
        _board(w, root, rp, numa, nodes[numa])
        if base in (0x5a, 0xd8):  # dual-port ConnectX-7 for storage, RoCE
            for fn in (0, 1):
                bdf = w.pci(rp, f"0000:{base + 1:02x}:00.{fn}", "0x020000", "0x15b3", "0x1021", numa,
                            nodes[numa], "mlx5_core", GEN5)
                name = next(names)
                netdev = f"enp{base + 1}s0f{fn}np{fn}"
                mac = f"94:6d:ae:{base:02x}:00:{fn:02x}"
                ll = f"fe80:0000:0000:0000:966d:aeff:fe{base:02x}:00{fn:02x}"
                down = base == 0xd8 and fn == 1
                mtu = 1500 if base == 0x5a and fn == 1 else 9000
                gids = [(ll, "IB/RoCE v1", netdev), (ll, "RoCE v2", netdev)]
                if mtu == 9000 and not down:
                    ip = ipv4_gid(f"10.{numa}.{fn}.{11 + numa}")
                    gids += [(ip, "IB/RoCE v1", netdev), (ip, "RoCE v2", netdev)]
                port = {"state": "1: DOWN" if down else "4: ACTIVE",
                        "phys_state": "3: Disabled" if down else "5: LinkUp", "link_layer": "Ethernet",
                        "rate": "200 Gb/sec (4X HDR)", "lid": "0x0", "gids": gids}
                w.rdma(name, bdf, "MT4129", _guid(base + fn), [port])
                w.net(netdev, bdf, mtu, "down" if down else "up", mac, speed=None if down else 200000)
            continue
        # Compute complex: switch SW1 under the root port, two second-level switches below it,
        # each with one ConnectX-7 (InfiniBand, IPoIB netdev) and one H100; an NVMe on SW1.
        up = w.pci(rp, f"0000:{base + 1:02x}:00.0", BRIDGE, "0x1000", "0xc030", numa, nodes[numa],
                   "pcieport", GEN5)
        for pair in (0, 1):
            b = base + 3 + 5 * pair
            dn = w.pci(up, f"0000:{base + 2:02x}:{pair:02x}.0", BRIDGE, "0x1000", "0xc030", numa,
                       nodes[numa], "pcieport", GEN5)
            up2 = w.pci(dn, f"0000:{b:02x}:00.0", BRIDGE, "0x1000", "0xc030", numa, nodes[numa],
                        "pcieport", GEN5)
            dn_nic = w.pci(up2, f"0000:{b + 1:02x}:00.0", BRIDGE, "0x1000", "0xc030", numa,
                           nodes[numa], "pcieport", GEN5)
            dn_gpu = w.pci(up2, f"0000:{b + 1:02x}:01.0", BRIDGE, "0x1000", "0xc030", numa,
                           nodes[numa], "pcieport", GEN5)
            nic = w.pci(dn_nic, f"0000:{b + 2:02x}:00.0", "0x020700", "0x15b3", "0x1021", numa,
                        nodes[numa], "mlx5_core", GEN5)
            name = next(names)
            guid = _guid(b + 2)
            gid0 = "fe80:0000:0000:0000:" + guid
            w.rdma(name, nic, "MT4129", guid, [dict(IB, lid=f"0x{b + 2:x}",
                                                    gids=[(gid0, "IB/RoCE v1", "")])])
            hexguid = guid.replace(":", "")
            ipoib = "00:00:10:29:fe:80:00:00:00:00:00:00:" + ":".join(
                hexguid[i:i + 2] for i in range(0, 16, 2))
            w.net(f"ibp{b + 2}s0", nic, 4092, "up", ipoib, typ=32, speed=400000)
            g = w.pci(dn_gpu, f"0000:{b + 3:02x}:00.0", "0x030200", "0x10de", "0x2330", numa,
                      nodes[numa], "nvidia", GEN5)
            w.nvidia_gpu(g, H100, _uuid(1, gpu), gpu)
            gpu += 1
        sw1_nvme = w.pci(up, f"0000:{base + 2:02x}:02.0", BRIDGE, "0x1000", "0xc030", numa,
                         nodes[numa], "pcieport", GEN4)
        w.pci(sw1_nvme, f"0000:{base + 13:02x}:00.0", "0x010802", "0x144d", "0xa80a", numa,
              nodes[numa], "nvme", ("16.0 GT/s PCIe", "4"))
    w.file("pdkv-capture/nvidia-smi.csv", "\n".join(
        f"{i}, 0000{bdf.upper()}, {_uuid(1, i)}, {H100}" for i, bdf in enumerate(sorted(
            b for b in w.pci_paths if b.endswith(":00.0") and _is_gpu_path(w, b)))))
    w.net("docker0", None, 1500, "down", "02:42:5e:11:22:33")
    w.net("lo", None, 65536, "unknown", "00:00:00:00:00:00", typ=772)
    w.capture_info("dgx-h100-like", "Linux 5.15.0-1042-nvidia x86_64")


def _is_gpu_path(w: HostWriter, bdf: str) -> bool:
    return w.files[f"{w.pci_paths[bdf]}/vendor"] == "0x10de\n"


def aws_p5(w: HostWriter) -> None:
    nodes = {0: "0-47,96-143", 1: "48-95,144-191"}
    for n, cpus in nodes.items():
        w.numa(n, cpus, 1031000000)
    w.file("sys/devices/system/cpu/online", "0-191")
    w.pci("pci0000:00", "0000:00:00.0", "0x060000", "0x1d0f", "0x0200", 0, nodes[0])
    w.pci("pci0000:00", "0000:00:05.0", "0x020000", "0x1d0f", "0xec20", 0, nodes[0], "ena")
    w.net("ens5", "0000:00:05.0", 9001, "up", "0e:3a:11:22:33:44")
    for g, base in enumerate((0x44, 0x55, 0x66, 0x77, 0xa4, 0xb5, 0xc6, 0xd7)):
        numa = 0 if g < 4 else 1
        root, rp = f"pci0000:{base:02x}", f"0000:{base:02x}:01.0"
        _board(w, root, rp, numa, nodes[numa])
        up = w.pci(rp, f"0000:{base + 1:02x}:00.0", BRIDGE, "0x1000", "0xc030", numa, nodes[numa],
                   "pcieport", GEN5)
        for k in range(6):  # downstream ports: 4 EFA, the GPU, an NVMe
            dn = w.pci(up, f"0000:{base + 2:02x}:{k:02x}.0", BRIDGE, "0x1000", "0xc030", numa,
                       nodes[numa], "pcieport", GEN5)
            bus = base + 3 + k
            bdf = f"0000:{bus:02x}:00.0"
            if k < 4:
                w.pci(dn, bdf, "0x020000", "0x1d0f", "0xefa2", numa, nodes[numa], "efa", GEN4)
                w.rdma(f"rdmap{bus}s0", bdf, "efa", f"0e{bus:02x}:11ff:fe22:00{k:02x}", [{
                    "state": "4: ACTIVE", "phys_state": "5: LinkUp", "link_layer": "Unspecified",
                    "rate": "100 Gb/sec (4X EDR)", "lid": "0x0",
                    "gids": [(f"fe80:0000:0000:0000:0e{bus:02x}:11ff:fe22:00{k:02x}", "", "")]}])
            elif k == 4:
                w.pci(dn, bdf, "0x030200", "0x10de", "0x2330", numa, nodes[numa], "nvidia", GEN5)
                w.nvidia_gpu(bdf, H100, _uuid(5, g), g)
            else:
                w.pci(dn, bdf, "0x010802", "0x1d0f", "0xcd01", numa, nodes[numa], "nvme",
                      ("16.0 GT/s PCIe", "4"))
    w.net("lo", None, 65536, "unknown", "00:00:00:00:00:00", typ=772)
    w.capture_info("aws-p5-like", "Linux 6.1.0-1029-aws x86_64")


def no_accel(w: HostWriter) -> None:
    nodes = {0: "0-15,32-47", 1: "16-31,48-63"}
    for n, cpus in nodes.items():
        w.numa(n, cpus, 263900000)
    w.file("sys/devices/system/cpu/online", "0-63")
    w.pci("pci0000:00", "0000:00:00.0", "0x060000", "0x8086", "0x09a2", 0, nodes[0])
    w.pci("pci0000:00", "0000:00:1c.0", BRIDGE, "0x8086", "0xa190", 0, nodes[0], "pcieport", GEN4)
    for fn, name, state, speed in ((0, "eno1", "up", 10000), (1, "eno2", "down", None)):
        w.pci("0000:00:1c.0", f"0000:01:00.{fn}", "0x020000", "0x8086", "0x1572", 0, nodes[0],
              "i40e", ("8.0 GT/s PCIe", "8"))
        w.net(name, f"0000:01:00.{fn}", 1500, state, f"3c:ec:ef:00:11:{fn:02x}", speed=speed)
    w.pci("pci0000:00", "0000:00:1c.4", BRIDGE, "0x8086", "0xa194", 0, nodes[0], "pcieport")
    w.pci("0000:00:1c.4", "0000:02:00.0", BRIDGE, "0x1a03", "0x1150", 0, nodes[0])
    w.pci("0000:02:00.0", "0000:03:00.0", "0x030000", "0x1a03", "0x2000", 0, nodes[0], "ast")
    _board(w, "pci0000:80", "0000:80:01.0", 1, nodes[1])
    w.pci("0000:80:01.0", "0000:81:00.0", "0x010802", "0x144d", "0xa80a", 1, nodes[1], "nvme",
          ("16.0 GT/s PCIe", "4"))
    w.net("docker0", None, 1500, "up", "02:42:5e:aa:bb:cc")
    w.net("veth1a2b3c", None, 1500, "up", "d6:11:22:33:44:55")
    w.net("lo", None, 65536, "unknown", "00:00:00:00:00:00", typ=772)
    w.capture_info("no-accel", "Linux 6.8.0-49-generic x86_64")


HOSTS = {"dgx-h100": dgx_h100, "aws-p5": aws_p5, "no-accel": no_accel}


def build(name: str) -> HostWriter:
    w = HostWriter()
    HOSTS[name](w)
    return w


def write(name: str, out: str) -> None:
    shutil.rmtree(out, ignore_errors=True)
    build(name).save(out)


if __name__ == "__main__":
    for host in sys.argv[1:] or sorted(HOSTS):
        write(host, os.path.join(FIXTURES, host))
        print(f"wrote {os.path.join(FIXTURES, host)}")
