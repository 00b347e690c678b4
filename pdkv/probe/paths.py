"""The fastest path from each GPU, with the probe's verdict on its NICs: for every GPU the NICs
the messenger would place it on (pdkv.topo: same PCIe switch first, then NUMA node, then any;
docs/TOPO.md) and whether the probe found each usable."""

from __future__ import annotations

from pdkv.probe.report import DeviceReport


def gpu_paths(topology, reports: tuple[DeviceReport, ...]) -> list[dict]:
    """[{gpu, nics: [{name, distance, verdict}], reason}] for every GPU of ``topology``;
    verdict: "OK", "NOT USABLE" or "not probed"."""
    from pdkv.topo.placement import gpu_mapping, nic_distance  # noqa: PLC0415

    by_name = {r.name: r for r in reports}
    out = []
    for gpu, plc, err in gpu_mapping(topology) if topology is not None and topology.rdma else ():
        nics = []
        for n in plc.nics if plc is not None else ():
            r = by_name.get(n)
            tier = nic_distance(topology, gpu, topology.rdma_device(n))[0]
            nics.append({"name": n, "distance": tier,
                         "verdict": "not probed" if r is None else ("OK" if r.ok else "NOT USABLE")})
        out.append({"gpu": gpu.bus_id, "nics": nics, "reason": plc.reason if plc is not None else err})
    return out


def path_lines(paths: list[dict]) -> list[str]:
    lines = []
    for p in paths:
        via = ", ".join(f"{n['name']} [{n['distance']}] {n['verdict']}" for n in p["nics"]) or "no NIC"
        lines.append(f"GPU {p['gpu']} -> {via}")
    return lines
