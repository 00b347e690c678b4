"""What the probe found on one RDMA device, and how it is said: one line, or a dict for --json.

A device is usable when the probe found no ``Problem``: each problem names what is missing and
the fix, in the words an operator types (``ulimit -l``, ``ip addr add``, ``modprobe``). Notes
are things that work but cost speed (a RoCE MTU of 1024, no GPUDirect where the KV can be
staged); they never make the device unusable.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

# ibv_port_attr codes -> words (verbs.h; ibv_devinfo prints the same)
PORT_STATES = {0: "NOP", 1: "DOWN", 2: "INIT", 3: "ARMED", 4: "ACTIVE", 5: "ACTIVE_DEFER"}
PHYS_STATES = {1: "Sleep", 2: "Polling", 3: "Disabled", 4: "PortConfigurationTraining", 5: "LinkUp",
               6: "LinkErrorRecovery", 7: "PhyTest"}
LINK_LAYERS = {0: "Unspecified", 1: "InfiniBand", 2: "Ethernet"}
MTUS = {1: 256, 2: 512, 3: 1024, 4: 2048, 5: 4096}
WIDTHS = {1: 1, 2: 4, 4: 8, 8: 12, 16: 2}  # lanes
SPEEDS = {1: ("SDR", 2.5), 2: ("DDR", 5.0), 4: ("QDR", 10.0), 8: ("FDR10", 10.3125), 16: ("FDR", 14.0625),
          32: ("EDR", 25.78125), 64: ("HDR", 53.125), 128: ("NDR", 106.25), 256: ("XDR", 212.5)}
GID_TYPES = {0: "IB", 1: "RoCE v1", 2: "RoCE v2"}  # ibv_gid_entry.gid_type


def rate(speed: int, width: int) -> str:
    """'4X EDR (100 Gb/s)' from ibv_port_attr.active_speed / active_width."""
    name, lane = SPEEDS.get(speed, (f"speed {speed}", 0.0))
    lanes = WIDTHS.get(width, 0)
    gbps = lane * lanes
    # the usual names round the signalling rate: 4X EDR is "100 Gb/s", 4X NDR "400 Gb/s"
    nominal = {25.78125: 25, 53.125: 50, 106.25: 100, 212.5: 200, 14.0625: 14, 10.3125: 10}.get(lane, lane)
    return f"{lanes or '?'}X {name} ({nominal * lanes:g} Gb/s)" if gbps else f"{name}, width {width}"


@dataclass(frozen=True)
class Problem:
    what: str  # what is missing or broken
    fix: str  # how to fix it

    def __str__(self) -> str:
        return f"{self.what}: {self.fix}" if self.fix else self.what


@dataclass(frozen=True)
class GidInfo:
    index: int
    gid: str
    type: str  # "IB", "RoCE v1", "RoCE v2" or "" when unknown


@dataclass(frozen=True)
class PortInfo:
    num: int
    state: str
    phys_state: str
    link_layer: str
    rate: str
    active_mtu: int | None
    max_mtu: int | None
    lid: int
    gids: tuple[GidInfo, ...] = ()

    @property
    def active(self) -> bool:
        return self.state == "ACTIVE"

    @property
    def routable_roce_v2(self) -> list[GidInfo]:
        return [g for g in self.gids if g.type == "RoCE v2" and not g.gid.startswith("fe80:")]


@dataclass(frozen=True)
class DeviceReport:
    name: str
    backend: str  # "pyverbs" or "messenger"
    port: int  # the port pdkv uses
    problems: tuple[Problem, ...] = ()
    notes: tuple[str, ...] = ()
    checks: tuple[str, ...] = ()  # what was done and worked, in order
    ports: tuple[PortInfo, ...] = ()
    attrs: dict = field(default_factory=dict)  # max_mr_size, max_qp, max_cqe, max_qp_wr, fw_ver
    host_bytes: int = 0  # host memory registered and deregistered (the KV cache or staging ring)
    gpudirect: str = ""  # "dma-buf", "nvidia-peermem", "none" or "" (not checked)

    @property
    def ok(self) -> bool:
        return not self.problems

    def line(self) -> str:
        """One line: ``mlx5_0 port 1: OK (...)`` or what is missing and how to fix it."""
        head = f"{self.name} port {self.port}"
        if not self.ok:
            return f"{head}: NOT USABLE: " + "; ".join(str(p) for p in self.problems)
        p = next((p for p in self.ports if p.num == self.port), None)
        facts = [f"{p.link_layer}, {p.rate}, MTU {p.active_mtu}"] if p else []
        if self.host_bytes:
            facts.append(f"registered {self.host_bytes / 2**20:.1f} MiB of host memory")
        if self.gpudirect:
            facts.append(f"GPUDirect: {self.gpudirect}")
        facts.append(f"via {self.backend}")
        text = f"{head}: OK ({'; '.join(facts)})"
        return text + ("; note: " + "; ".join(self.notes) if self.notes else "")

    def to_dict(self) -> dict:
        d = asdict(self)
        d["ok"] = self.ok
        d["problems"] = [{"what": p.what, "fix": p.fix} for p in self.problems]
        d["line"] = self.line()
        return d
