"""The probe through pdkv's own verbs transport (pdkv._messenger, pdkv/csrc/verbs*.c), where
pyverbs cannot be imported: the same checks, made by the code that will carry the KV.

Opening a verbs ``Messenger`` on the NIC opens the device, checks that the port is ACTIVE (and
has a LID on InfiniBand), picks the GID and allocates a PD, a completion channel, a CQ and an
SRQ. Two of them on the same NIC connect RC QPs to each other and one RDMA WRITE must land
byte-exact. The host memory pdkv would register is registered through ``Messenger.register``,
GPU memory through ``Messenger.register_device`` (dma-buf only, then the pointer only). The
transport does not hand out port attributes: they come from sysfs (pdkv.topo) when the device
is there, else the report says they were not queried.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import mmap
import os
import re
import time

from pdkv.probe import checks
from pdkv.probe.gpu import DeviceMemory, try_gpudirect
from pdkv.probe.report import PORT_STATES, DeviceReport, GidInfo, PortInfo, Problem

WRITE_BYTES = 4096


def device_names() -> list[str]:
    """ibv_get_device_list through ctypes: the names libibverbs (or its stand-in) reports."""
    lib = ctypes.CDLL("libibverbs.so.1")
    lib.ibv_get_device_list.restype = ctypes.POINTER(ctypes.c_void_p)
    lib.ibv_get_device_list.argtypes = [ctypes.POINTER(ctypes.c_int)]
    lib.ibv_get_device_name.restype = ctypes.c_char_p
    lib.ibv_get_device_name.argtypes = [ctypes.c_void_p]
    lib.ibv_free_device_list.argtypes = [ctypes.POINTER(ctypes.c_void_p)]
    num = ctypes.c_int(0)
    devices = lib.ibv_get_device_list(ctypes.byref(num))
    if not devices:
        return []
    try:
        return [lib.ibv_get_device_name(devices[i]).decode() for i in range(num.value)]
    finally:
        lib.ibv_free_device_list(devices)


def port_from_topo(p) -> PortInfo:
    """A sysfs port (pdkv.topo.RdmaPort) in the probe's terms."""
    ether = p.link_layer == "Ethernet"
    gids = tuple(GidInfo(g.index, g.gid, "RoCE v2" if g.type == "RoCE v2" else ("RoCE v1" if ether else "IB"))
                 for g in p.gids)
    lid = int(p.lid, 16) if p.lid.startswith("0x") else int(p.lid or 0)
    return PortInfo(p.num, p.state, p.phys_state, p.link_layer, p.rate, p.roce_mtu if ether else None, None,
                    lid, gids)


def _wait_batch(m, tag: int, deadline: float):
    while time.monotonic() < deadline:
        for e in m.drain():
            if e.kind == "batch_done" and e.tag == tag:
                return e
            if e.kind == "error":
                raise RuntimeError(e.reason or os.strerror(-e.status))
        time.sleep(0.002)
    raise RuntimeError("no completion within 5 s")


def _self_write(a, b) -> None:
    """a -> b over RC QPs on one NIC: one WRITE, byte-exact."""
    ca, ia = a.prepare(b.node_id)
    cb, ib = b.prepare(a.node_id)
    a.complete(ca, ib)
    b.complete(cb, ia)
    src, dst = bytearray(bytes(range(256)) * (WRITE_BYTES // 256)), bytearray(WRITE_BYTES)
    lkey, rkey = a.register(src), b.register(dst)
    a.write(ca, lkey, 0, rkey, 0, WRITE_BYTES, tag=7)
    e = _wait_batch(a, 7, time.monotonic() + 5.0)
    if e.num_errors:
        raise RuntimeError(e.reason or "the write completed with an error")
    if dst != src:
        raise RuntimeError("the write completed but the bytes did not arrive")
    a.deregister(lkey)
    b.deregister(rkey)


def _open_problem(name: str, message: str, port: PortInfo | None, netdev: str | None,
                  available: list[str]) -> list[Problem]:
    if "not found" in message:
        return [checks.not_found_problem(name, available)]
    if "not active" in message or "no LID" in message:
        if port is not None:
            bad, _ = checks.port_problems(name, port.num, port, 1, netdev)
            if bad:
                return bad
        m = re.search(r"port (\d+) of NIC \S+ is not active \(state (\d+)\)", message)
        what = (f"port {m.group(1)} is {PORT_STATES.get(int(m.group(2)), m.group(2))} (pdkv's verbs "
                "transport refused it)") if m else message
        return [Problem(what, f"bring the link up: RoCE: `ip link set {netdev or 'IFACE'} up` "
                              f"(`rdma link show {name}` names IFACE), and check the cable and the "
                              "switch port; InfiniBand: a subnet manager must run (opensm or the switch's)")]
    if "no RDMA device" in message:
        return [checks.no_device_problem()]
    return [checks.open_problem(message)]


def probe(name: str, port_num: int, host_bytes: int, what: str, limit: int | None,
          netdev: str | None = None, gpu: DeviceMemory | None = None, sysfs_port=None,
          available: list[str] = ()) -> DeviceReport:
    from pdkv._messenger import Messenger, MessengerError  # noqa: PLC0415 - the compiled transport
    from pdkv.transports import VerbsOptions  # noqa: PLC0415

    port = port_from_topo(sysfs_port) if sysfs_port is not None else None
    report = dict(name=name, backend="messenger", port=port_num, ports=(port,) if port else ())
    notes = [] if port else ["port attributes not queried (pdkv's transport does not report them "
                             "and the device is not in sysfs)"]
    opened = []
    try:
        for node in (0x70b0e001, 0x70b0e002):
            opened.append(Messenger("verbs", node, VerbsOptions(nics=(name,), port_num=port_num)))
    except MessengerError as e:
        for m in opened:
            m.close()
        return DeviceReport(**report, problems=tuple(_open_problem(name, str(e.strerror or e), port, netdev,
                                                                   list(available))))
    a, b = opened
    problems, done = [], ["opened the device: port ACTIVE, GID chosen, PD, CQ and SRQ made (pdkv's verbs "
                          "transport)"]
    try:
        if port is not None:
            bad, port_notes = checks.port_problems(name, port_num, port, 1, netdev)
            problems += bad
            notes += port_notes
        try:
            _self_write(a, b)
            done.append(f"RDMA WRITE of {WRITE_BYTES} bytes between two RC QPs on the NIC")
        except (MessengerError, RuntimeError) as e:
            problems.append(Problem(f"two RC QPs on the NIC could not move data: {e}",
                                    "check the link and addressing (`rdma link`, `ibv_devinfo -v`; RoCE: "
                                    "the interface's IP address and MTU)"))
        host = _host_memory(a, host_bytes, what, limit, done) if host_bytes else []
        problems += host
        gpudirect = ""
        if gpu is not None:
            r = try_gpudirect(gpu, lambda fd, n, iova: a.deregister(a.register_device(fd, 0, n, 0)[0]),
                              lambda ptr, n: a.deregister(a.register_device(-1, 0, n, ptr)[0]))
            gpudirect = f"{r.label}: {r.summary}"
            notes += [f"GPUDirect {r.label}: {f}" for f in r.failures]
        return DeviceReport(**report, problems=tuple(problems), notes=tuple(notes), checks=tuple(done),
                            host_bytes=0 if host else host_bytes, gpudirect=gpudirect)
    finally:
        a.close()
        b.close()


def _host_memory(m, nbytes: int, what: str, limit: int | None, done: list) -> list[Problem]:
    from pdkv._messenger import MessengerError  # noqa: PLC0415

    p = checks.memlock_problem(nbytes, limit, what)
    if p is not None:
        return [p]
    buf = mmap.mmap(-1, nbytes)
    try:
        m.deregister(m.register(buf))
    except (MessengerError, MemoryError) as e:
        code = getattr(e, "errno", None) or errno.ENOMEM
        return [checks.registration_problem(code, nbytes, limit, what, str(e))]
    finally:
        buf.close()
    done.append(f"registered {what}: {nbytes / 2**20:.1f} MiB of host memory")
    return []
