"""The verdicts both probe backends share: a port's state, its addresses, its MTU, the memory
lock limit and the device's MR size, each turned into a ``Problem`` that says how to fix it.

These are what ``ibv_devinfo``, ``rdma link``, ``ulimit -l`` and NCCL's start-up lines tell an
operator one at a time; here they come from the port and device attributes the backend queried.
"""

from __future__ import annotations

import errno

from pdkv.probe.report import PortInfo, Problem

KIB = 1024


def port_problems(dev: str, port_num: int, port: PortInfo | None, num_ports: int,
                  netdev: str | None) -> tuple[list[Problem], list[str]]:
    """(problems, notes) of port ``port_num``, the one pdkv uses (``port`` None: no such port)."""
    if port is None:
        return [Problem(f"the device has no port {port_num} ({num_ports} port(s))",
                        f"name an existing port as NIC:PORT, e.g. {dev}:1, in messenger.nics")], []
    problems, notes = [], []
    iface = netdev or "IFACE"
    where = "" if netdev else f" (IFACE: the port's interface; `rdma link show {dev}/{port.num}` names it)"
    if not port.active:
        if port.state == "INIT" and port.link_layer == "InfiniBand":
            fix = ("the link is up but no subnet manager has configured the port: start one "
                   "(`systemctl start opensm` on one host of the fabric, or the switch's SM)")
        elif port.link_layer == "Ethernet":
            fix = (f"bring the link up: `ip link set {iface} up`{where}, and check the cable and the "
                   "switch port")
        else:
            fix = f"check the cable and the switch port (`rdma link show {dev}/{port.num}`, `ibstat {dev}`)"
        problems.append(Problem(f"port {port.num} is {port.state} (physical state {port.phys_state})", fix))
        return problems, notes
    if port.link_layer == "InfiniBand" and not port.lid:
        problems.append(Problem(f"InfiniBand port {port.num} has no LID",
                                "no subnet manager has assigned one: start opensm or the switch's SM"))
    if port.link_layer == "Ethernet":
        if not port.gids:
            problems.append(Problem(f"RoCE port {port.num} has an empty GID table",
                                    f"give {iface} an IP address (`ip addr add ADDR/PREFIX dev {iface}`)"
                                    + where))
        elif not port.routable_roce_v2 and any(g.type for g in port.gids):
            notes.append(f"no routable RoCE v2 GID (only link-local/v1): traffic cannot cross an IP router; "
                         f"give {iface} an IP address")
        if port.active_mtu is not None and port.active_mtu < 4096:
            notes.append(f"RoCE path MTU {port.active_mtu}: set {iface}'s MTU to 4200 or more "
                         "(9000 is usual)")
    return problems, notes


def memlock_problem(nbytes: int, limit: int | None, what: str) -> Problem | None:
    """Where ``nbytes`` cannot be pinned under RLIMIT_MEMLOCK (``limit`` None: unlimited or
    CAP_IPC_LOCK, as pdkv._messenger.locked_memory_limit says), the limit to set."""
    if limit is None or nbytes <= limit:
        return None
    return memlock(nbytes, limit, what)


def memlock(nbytes: int, limit: int | None, what: str) -> Problem:
    need_kib = -(-nbytes // KIB)
    have = "unlimited" if limit is None else f"{limit // KIB} KiB"
    return Problem(
        f"registering {what} ({nbytes / 2**20:.1f} MiB) pins that much memory, but RLIMIT_MEMLOCK "
        f"allows this process {have}",
        f"raise the limit to at least {need_kib} KiB: `ulimit -l unlimited` (or `ulimit -l {need_kib}`) "
        f"in the shell that starts pdkv; systemd: LimitMEMLOCK=infinity; docker: --ulimit memlock=-1; "
        f"/etc/security/limits.conf: `* - memlock unlimited`; or grant CAP_IPC_LOCK")


def registration_problem(err: int, nbytes: int, limit: int | None, what: str, detail: str) -> Problem:
    """A failed ibv_reg_mr of host memory, in words: ENOMEM/EPERM/EAGAIN are the pinning limit."""
    if err in (errno.ENOMEM, errno.EPERM, errno.EAGAIN):
        if limit is not None:
            return memlock(nbytes, limit, what)
        return Problem(f"ibv_reg_mr of {what} ({nbytes / 2**20:.1f} MiB) could not pin the pages "
                       f"({detail}) although RLIMIT_MEMLOCK does not bind here (unlimited or "
                       "CAP_IPC_LOCK)", "check free memory and the memory cgroup's limit "
                       "(memory.max) of this service or container, and `dmesg`")
    return Problem(f"ibv_reg_mr of {what} ({nbytes / 2**20:.1f} MiB) failed: {detail}",
                   "check `dmesg` for the NIC driver's message")


def mr_size_problem(nbytes: int, max_mr_size: int, what: str) -> Problem | None:
    if max_mr_size and nbytes > max_mr_size:
        return Problem(f"{what} ({nbytes / 2**30:.2f} GiB) is larger than the device's largest memory "
                       f"region (max_mr_size {max_mr_size / 2**30:.2f} GiB)",
                       "lower kv_cache.memory_gib / kv_cache.num_pages, or use a NIC with a larger "
                       "max_mr_size")
    return None


def no_device_problem() -> Problem:
    return Problem("no RDMA device (libibverbs lists none)",
                   "load the NIC's RDMA driver (mlx5_ib, efa, irdma, bnxt_re...), install ibverbs-providers, "
                   "and in a container pass --device=/dev/infiniband; or use messenger.transport tcp")


def not_found_problem(name: str, available: list[str]) -> Problem:
    return Problem(f"no RDMA device named {name!r} (available: {', '.join(available) or 'none'})",
                   "fix messenger.nics (or --nics) to name one of them")


def open_problem(detail: str) -> Problem:
    return Problem(f"cannot open the device: {detail}",
                   "check that /dev/infiniband/uverbs* exist and this user may open them (in a container: "
                   "--device=/dev/infiniband), and that ibverbs-providers has this NIC's provider")


def resource_problem(what: str, detail: str) -> Problem:
    return Problem(f"{what} failed: {detail}",
                   "the device refused a basic verbs object: check `dmesg` and the driver/firmware "
                   "(`ibv_devinfo -v`); a device in a bad state needs a driver reload")
