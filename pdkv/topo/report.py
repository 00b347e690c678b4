"""The readable report ``tools/topo`` prints by default (built from ``render.to_dict``)."""

from __future__ import annotations

from pdkv.topo.model import Topology
from pdkv.topo.render import _tree_lines, to_dict


def table(rows: list[list[str]], indent: str = "  ") -> list[str]:
    widths = [max(len(str(r[i])) for r in rows) for i in range(len(rows[0]))]
    return [indent + "  ".join(str(c).ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]


def _gib(kib: int | None) -> str:
    return f"{kib / 1048576:.1f} GiB" if kib else "-"


def format_report(topology: Topology, nics=("auto",), gpu: str | None = None,
                  data: dict | None = None) -> str:
    """The report; ``data`` is ``to_dict(topology, nics, gpu)`` when the caller already has it."""
    d = data if data is not None else to_dict(topology, nics, gpu)
    out = [f"pdkv topology of {'this machine' if d['sysfs_root'] == '/' else d['sysfs_root']}"]
    out += [f"  {s}" for s in d["summary"]]

    out += ["", f"NUMA nodes ({len(d['numa_nodes'])}; online CPUs {d['online_cpus']})"]
    out += table([["node", "cpus", "count", "memory"]]
                 + [[n["id"], n["cpus"], n["num_cpus"], _gib(n["mem_total_kib"])] for n in d["numa_nodes"]])

    out += ["", f"GPUs ({len(d['gpus'])})"]
    if d["gpus"]:
        ordinals = {b: i for i, b in d["cuda"]["ordinals"].items()}
        out += table([["bus id", "model", "uuid", "numa", "cuda", "pcie link"]]
                     + [[g["bus_id"], g["model"] or g["pci"]["name"], g["uuid"] or "-",
                         g["pci"]["numa_node"], f"cuda:{ordinals[g['bus_id']]}" if g["bus_id"] in ordinals
                         else "hidden", g["pci"]["link"] or "-"] for g in d["gpus"]])
        c = d["cuda"]
        visible = c["CUDA_VISIBLE_DEVICES"]
        out.append(f"  CUDA_VISIBLE_DEVICES={visible if visible is not None else '(unset)'}"
                   f" CUDA_DEVICE_ORDER={c['CUDA_DEVICE_ORDER'] or '(unset)'}: "
                   + (", ".join(f"cuda:{i} = {b}" for i, b in c["ordinals"].items()) or "no GPU visible"))
        out += [f"  note: {n}" for n in c["notes"]]
    else:
        out.append("  none")

    out += ["", f"RDMA devices ({len(d['rdma_devices'])})"]
    rows = [["device", "port", "state", "link layer", "rate", "netdev", "mtu", "pci", "numa", "use gid",
             "gids"]]
    for r in d["rdma_devices"]:
        for p in r["ports"] or [{}]:
            mtu = p.get("netdev_mtu")
            mtu_text = "-" if mtu is None else str(mtu)
            if p.get("roce_mtu"):
                mtu_text += f" (RoCE {p['roce_mtu']})"
            gids = ", ".join(f"{g['index']}:{g['gid']}" + (f" {g['type']}" if g["type"] else "")
                             for g in p.get("gids", [])[:4])
            if len(p.get("gids", [])) > 4:
                gids += f", +{len(p['gids']) - 4} more"
            rows.append([r["name"], p.get("num", "-"), p.get("state", "-"), p.get("link_layer", "-"),
                         p.get("rate", "-"), p.get("netdev") or "-", mtu_text,
                         r["pci"]["bdf"] if r["pci"] else "(none)",
                         r["pci"]["numa_node"] if r["pci"] else "-",
                         "-" if p.get("suggested_gid_index") is None else p["suggested_gid_index"],
                         gids or "-"])
    out += table(rows) if d["rdma_devices"] else ["  none"]

    out += ["", f"Network interfaces ({len(d['net_interfaces'])})"]
    out += table([["name", "state", "mtu", "speed", "pci", "numa", "rdma", "address"]]
                 + [[n["name"], n["operstate"], n["mtu"] if n["mtu"] is not None else "-",
                     f"{n['speed_mbps'] // 1000} Gb/s" if n["speed_mbps"] and n["speed_mbps"] >= 1000
                     else (f"{n['speed_mbps']} Mb/s" if n["speed_mbps"] else "-"),
                     n["pci"]["bdf"] if n["pci"] else "(virtual)",
                     n["pci"]["numa_node"] if n["pci"] else "-", n["rdma"] or "-", n["address"]]
                    for n in d["net_interfaces"]])

    lines, hidden = _tree_lines(topology)
    out += ["", f"PCIe tree (GPUs, NICs and the bridges above them; {hidden} other PCI devices not shown)"]
    out += [f"  {line}" for line in lines] or ["  (no GPU or NIC on the PCI bus)"]

    label = ",".join(nics) if not isinstance(nics, str) else nics
    out += ["", f"Messenger placement (nics: {label}): GPU -> NICs -> poller CPUs"]
    for p in d["placement"]:
        who = f"GPU {p['gpu']}" + (f" (cuda:{p['cuda_ordinal']})" if p["cuda_ordinal"] is not None else "") \
            if p["gpu"] else "no GPU"
        if p["error"]:
            out.append(f"  {who}: error: {p['error']}")
            continue
        nic_text = ", ".join(f"{n} [{p['distance'][n]}]" if n in p["distance"] else n for n in p["nics"])
        out.append(f"  {who} -> {nic_text} -> CPUs {p['cpus']}")
        out.append(f"      {p['reason']}")

    if d["warnings"]:
        out += ["", f"Warnings ({len(d['warnings'])})"] + [f"  - {w}" for w in d["warnings"]]
    if d["notes"]:
        out += ["", "Notes"] + [f"  - {n}" for n in d["notes"]]
    return "\n".join(out) + "\n"
