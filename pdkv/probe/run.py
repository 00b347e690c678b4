"""Run the probe over the RDMA devices asked for: choose the backend, find the devices, share
one GPU allocation among them, and turn "GPUDirect required but none works" into a problem.

    result = run_probe(nics=["mlx5_0"], host_bytes=1 << 30, what="the KV cache")
    result.ok, [r.line() for r in result.reports]
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from pdkv.probe import checks, via_messenger, via_pyverbs
from pdkv.probe.gpu import DeviceMemory, lacks_text
from pdkv.probe.report import DeviceReport, Problem

BACKENDS = ("auto", "pyverbs", "messenger")


class ProbeUnavailable(RuntimeError):
    """The backend asked for cannot run here (pyverbs not importable, pdkv built without verbs)."""


@dataclass(frozen=True)
class ProbeResult:
    backend: str  # which pyverbs, or "pdkv's verbs messenger"
    reports: tuple[DeviceReport, ...]
    problems: tuple[Problem, ...] = ()  # not of one device: no device at all
    notes: tuple[str, ...] = ()  # why pyverbs was not used, why GPUDirect was not checked
    gpu: str = ""  # the GPU memory used for the GPUDirect checks, "" none

    @property
    def ok(self) -> bool:
        return not self.problems and bool(self.reports) and all(r.ok for r in self.reports)

    def failures(self) -> list[str]:
        return [str(p) for p in self.problems] + [r.line() for r in self.reports if not r.ok]

    def to_dict(self) -> dict:
        return {"ok": self.ok, "backend": self.backend, "gpu": self.gpu,
                "problems": [{"what": p.what, "fix": p.fix} for p in self.problems],
                "notes": list(self.notes), "devices": [r.to_dict() for r in self.reports]}


def choose_backend(backend: str = "auto"):
    """(pyverbs modules or None, description, notes). ProbeUnavailable when the one asked for
    cannot run."""
    if backend not in BACKENDS:
        raise ValueError(f"--backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
    notes = []
    if backend in ("auto", "pyverbs"):
        pv, where = via_pyverbs.load_pyverbs()
        if pv is not None:
            return pv, where, notes
        if backend == "pyverbs":
            raise ProbeUnavailable(f"pyverbs cannot be imported: {where}")
        notes.append(f"pyverbs not used: {where}")
    from pdkv._messenger import HAVE_VERBS  # noqa: PLC0415

    if not HAVE_VERBS:
        raise ProbeUnavailable("pdkv was built without libibverbs (install libibverbs-dev, then "
                               "`make install`)" + (f"; and {notes[0]}" if notes else ""))
    return None, "pdkv's verbs messenger (pdkv._messenger)", notes


def _split(nic: str) -> tuple[str, int]:
    name, _, port = nic.partition(":")
    if port and not port.isdigit():
        raise ValueError(f"NIC {nic!r}: the port after ':' must be a number")
    return name, int(port or 1)


def run_probe(nics=(), host_bytes: int = 0, what: str = "host memory", backend: str = "auto",
              gpu: DeviceMemory | None = None, gpu_note: str = "", gpudirect_required: bool = False,
              topology=None) -> ProbeResult:
    """Probe ``nics`` ("dev", "dev:port" or a network interface name; () = every device).
    ``topology`` (pdkv.topo) names interfaces and gives the messenger backend port attributes."""
    from pdkv._messenger import locked_memory_limit  # noqa: PLC0415

    pv, where, notes = choose_backend(backend)
    names = via_pyverbs.device_names(pv) if pv is not None else via_messenger.device_names()
    if gpu_note:
        notes.append(gpu_note)
    targets = [_split(n) for n in nics] or [(n, 1) for n in names]
    if not targets:
        return ProbeResult(where, (), (checks.no_device_problem(),), tuple(notes))
    limit = locked_memory_limit()
    if not host_bytes and limit is not None:
        notes.append(f"RLIMIT_MEMLOCK is {limit >> 10} KiB (no CAP_IPC_LOCK) and pdkv pins its whole KV "
                     "cache (or staging ring): check a config's size with -c CONFIG or --bytes SIZE, or "
                     "run pdkv with `ulimit -l unlimited`")
    reports = []
    for name, port in targets:
        sys_dev, sys_port, netdev = _sysfs(topology, name, port)
        if name not in names and sys_dev is not None and sys_dev.name in names:
            name = sys_dev.name  # an interface name: its RDMA device
        if name not in names:
            reports.append(DeviceReport(name, "pyverbs" if pv else "messenger", port,
                                        problems=(checks.not_found_problem(name, names),)))
            continue
        if pv is not None:
            r = via_pyverbs.probe(pv, name, port, host_bytes, what, limit, netdev, gpu)
        else:
            r = via_messenger.probe(name, port, host_bytes, what, limit, netdev, gpu, sys_port, names)
        if gpudirect_required and r.ok and (gpu is None or r.gpudirect.endswith(": none")):
            r = dataclasses.replace(r, problems=(Problem(
                "GPUDirect RDMA is required (messenger.staging off) but no way registers GPU memory with "
                f"this NIC ({gpu_note or r.gpudirect})",
                f"this host lacks: {lacks_text()}; or set messenger.staging auto to stage the KV through "
                "host memory"),))
        reports.append(r)
    return ProbeResult(where, tuple(reports), (), tuple(notes), gpu.label if gpu is not None else "")


def _sysfs(topology, name: str, port: int):
    """(sysfs RDMA device, its port, the port's interface) for a device or interface name."""
    if topology is None:
        return None, None, None
    dev = topology.rdma_device(name)
    if dev is None:
        iface = next((n for n in topology.net if n.name == name and n.rdma), None)
        dev = topology.rdma_device(iface.rdma) if iface is not None else None
    if dev is None:
        return None, None, None
    p = next((p for p in dev.ports if p.num == port), None)
    return dev, p, (p.netdev or None) if p is not None else None
