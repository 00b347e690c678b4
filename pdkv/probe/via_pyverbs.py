"""The probe through rdma-core's pyverbs: every check with the real verbs objects.

Which pyverbs: an importable ``pyverbs`` (PyPI's, or one on PYTHONPATH) first; else Debian's
``python3-pyverbs`` from /usr/lib/python3/dist-packages, loaded as the one package ``pyverbs``
(that directory is never put on sys.path: the rest of Debian's Python packages stay out of the
venv). Debian builds it for the system Python 3.11 against the system rdma-core, so it loads into
any CPython 3.11 (the extension suffix is checked first) and matches the installed libibverbs.

One device: open it, query the device and every port with its GID table, allocate a PD, create
a CQ and an RC QP, connect the QP to itself and move 4 KiB with an RDMA WRITE through the port,
register the host memory pdkv would register (after the RLIMIT_MEMLOCK check), and with GPU
memory try dma-buf and peer-memory registration.
"""

from __future__ import annotations

import importlib
import importlib.machinery
import importlib.util
import sys
import time
from pathlib import Path
from types import SimpleNamespace

from pdkv.probe import checks
from pdkv.probe.gpu import DeviceMemory, try_gpudirect
from pdkv.probe.report import (GID_TYPES, LINK_LAYERS, MTUS, PHYS_STATES, PORT_STATES, DeviceReport,
                               GidInfo, PortInfo, Problem, rate)

SYSTEM_DIRS = ("/usr/lib/python3/dist-packages",)
MODULES = ("device", "pd", "cq", "qp", "mr", "addr", "wr", "enums", "pyverbs_error")
WRITE_BYTES = 4096


def load_pyverbs() -> tuple[SimpleNamespace | None, str]:
    """(the pyverbs modules, where they came from) or (None, why pyverbs cannot be imported)."""
    try:
        return _modules(), _where()
    except ImportError as e:
        first = f"`import pyverbs` failed ({e})"
        _forget()  # a half-imported pyverbs must not shadow the system one
    for base in SYSTEM_DIRS:
        pkg = Path(base) / "pyverbs"
        if not (pkg / "__init__.py").exists():
            continue
        if not any((pkg / f"device{s}").exists() for s in importlib.machinery.EXTENSION_SUFFIXES):
            return None, (f"{first}; {pkg} is built for another Python (no device"
                          f"{importlib.machinery.EXTENSION_SUFFIXES[0]})")
        spec = importlib.util.spec_from_file_location("pyverbs", pkg / "__init__.py",
                                                      submodule_search_locations=[str(pkg)])
        sys.modules["pyverbs"] = module = importlib.util.module_from_spec(spec)
        try:
            spec.loader.exec_module(module)
            return _modules(), _where()
        except ImportError as e:
            _forget()
            return None, f"{first}; {pkg} does not load: {e}"
    return None, (f"{first}, and no python3-pyverbs in {', '.join(SYSTEM_DIRS)} "
                  "(`apt-get install python3-pyverbs`)")


def _where() -> str:
    where = Path(sys.modules["pyverbs.device"].__file__).parent
    debian = any(str(where).startswith(base) for base in SYSTEM_DIRS)
    return f"pyverbs ({'Debian python3-pyverbs, ' if debian else ''}{where})"


def _forget() -> None:
    for name in [n for n in sys.modules if n == "pyverbs" or n.startswith("pyverbs.")]:
        del sys.modules[name]


def _modules() -> SimpleNamespace:
    return SimpleNamespace(**{m: importlib.import_module(f"pyverbs.{m}") for m in MODULES})


def device_names(pv) -> list[str]:
    try:
        return [d.name.decode() for d in pv.device.get_device_list()]
    except pv.pyverbs_error.PyverbsError:  # rdma-core says "Failed to get devices list" for none
        return []


def _err(pv, e: Exception) -> tuple[int, str]:
    code = getattr(e, "error_code", 0) or 0
    return code, str(e).strip()


def _ports(pv, ctx, count: int) -> list[PortInfo]:
    out = []
    for num in range(1, count + 1):
        a = ctx.query_port(num)
        gids = []
        for i in range(min(a.gid_tbl_len, 256)):
            try:
                e = ctx.query_gid_ex(num, i)
            except pv.pyverbs_error.PyverbsError:  # an unset entry: ENODATA
                continue
            text = e.gid_str()
            if text.replace("0", "").replace(":", ""):
                gids.append(GidInfo(i, text, GID_TYPES.get(e.gid_type, str(e.gid_type))))
        out.append(PortInfo(num, PORT_STATES.get(a.state, str(a.state)),
                            PHYS_STATES.get(a.phys_state, str(a.phys_state)),
                            LINK_LAYERS.get(a.link_layer, str(a.link_layer)),
                            rate(a.active_speed, a.active_width), MTUS.get(a.active_mtu),
                            MTUS.get(a.max_mtu), a.lid, tuple(gids)))
    return out


def _gid_index(port: PortInfo) -> int:
    """The GID pdkv's verbs transport picks: a RoCE v2 GID with an IPv4 address, else any v2, else 0."""
    v2 = [g for g in port.gids if g.type == "RoCE v2"]
    mapped = [g for g in v2 if g.gid.startswith("0000:0000:0000:0000:0000:ffff:")]
    return (mapped or v2 or port.gids or [GidInfo(0, "", "")])[0].index


def _self_write(pv, ctx, pd, cq, port: PortInfo, max_qp_wr: int) -> None:
    """An RC QP connected to itself: INIT -> RTR -> RTS, one signaled RDMA WRITE, its completion."""
    e = pv.enums
    access = e.IBV_ACCESS_LOCAL_WRITE | e.IBV_ACCESS_REMOTE_WRITE
    mr = pv.mr.MR(pd, 2 * WRITE_BYTES, access)
    cap = pv.qp.QPCap(max_send_wr=min(1024, max_qp_wr), max_recv_wr=1, max_send_sge=1, max_recv_sge=1)
    qp = pv.qp.QP(pd, pv.qp.QPInitAttr(qp_type=e.IBV_QPT_RC, scq=cq, rcq=cq, cap=cap))
    try:
        attr = pv.qp.QPAttr(port_num=port.num)
        attr.qp_access_flags, attr.pkey_index = access, 0
        qp.to_init(attr)
        if port.link_layer == "InfiniBand":
            attr.ah_attr = pv.addr.AHAttr(port_num=port.num, dlid=port.lid)
        else:
            index = _gid_index(port)
            gr = pv.addr.GlobalRoute(dgid=ctx.query_gid(port.num, index), sgid_index=index)
            attr.ah_attr = pv.addr.AHAttr(gr=gr, is_global=1, port_num=port.num)
        attr.dest_qp_num, attr.path_mtu = qp.qp_num, {v: k for k, v in MTUS.items()}[port.active_mtu or 1024]
        attr.max_dest_rd_atomic, attr.min_rnr_timer, attr.rq_psn = 1, 12, 0
        qp.to_rtr(attr)
        attr.timeout, attr.retry_cnt, attr.rnr_retry, attr.sq_psn, attr.max_rd_atomic = 14, 7, 7, 0, 1
        qp.to_rts(attr)
        pattern = bytes(range(256)) * (WRITE_BYTES // 256)
        mr.write(pattern, WRITE_BYTES, 0)
        wr = pv.wr.SendWR(wr_id=1, opcode=e.IBV_WR_RDMA_WRITE, num_sge=1,
                          sg=[pv.wr.SGE(mr.buf, WRITE_BYTES, mr.lkey)], send_flags=e.IBV_SEND_SIGNALED)
        wr.set_wr_rdma(mr.rkey, mr.buf + WRITE_BYTES)
        qp.post_send(wr)
        deadline = time.monotonic() + 5.0
        while time.monotonic() < deadline:
            n, wcs = cq.poll()
            if n:
                if wcs[0].status != 0:
                    raise RuntimeError(f"the write completed with status {wcs[0].status}")
                if mr.read(WRITE_BYTES, WRITE_BYTES) != pattern:
                    raise RuntimeError("the write completed but the bytes did not arrive")
                return
            time.sleep(0.001)
        raise RuntimeError("no completion within 5 s")
    finally:
        qp.close()
        mr.close()


def probe(pv, name: str, port_num: int, host_bytes: int, what: str, limit: int | None,
          netdev: str | None = None, gpu: DeviceMemory | None = None) -> DeviceReport:
    """Every check on device ``name``; ``limit``: RLIMIT_MEMLOCK as pdkv reads it (None: none)."""
    problems: list[Problem] = []
    notes, done = [], []
    report = dict(name=name, backend="pyverbs", port=port_num)
    try:
        ctx = pv.device.Context(name=name)
    except pv.pyverbs_error.PyverbsError as e:
        return DeviceReport(**report, problems=(checks.open_problem(_err(pv, e)[1]),))
    try:
        a = ctx.query_device()
        attrs = dict(fw_ver=a.fw_version, max_mr_size=a.max_mr_size, max_qp=a.max_qp, max_qp_wr=a.max_qp_wr,
                     max_cq=a.max_cq, max_cqe=a.max_cqe, max_mr=a.max_mr, phys_port_cnt=a.phys_port_cnt)
        ports = _ports(pv, ctx, a.phys_port_cnt)
        done.append(f"queried the device and {len(ports)} port(s)")
        port = next((p for p in ports if p.num == port_num), None)
        bad, port_notes = checks.port_problems(name, port_num, port, len(ports), netdev)
        problems += bad
        notes += port_notes
        pd = pv.pd.PD(ctx)
        cq = pv.cq.CQ(ctx, min(a.max_cqe, 8192))
        done.append("allocated a PD and a CQ")
        if port is not None and port.active and not bad:
            try:
                _self_write(pv, ctx, pd, cq, port, a.max_qp_wr)
                done.append(f"RDMA WRITE of {WRITE_BYTES} bytes through port {port_num} to itself (RC QP)")
            except (pv.pyverbs_error.PyverbsError, RuntimeError) as e:
                problems.append(Problem(f"an RC QP connected to itself could not move data: {_err(pv, e)[1]}",
                                        "check the link and addressing (`rdma link`, `ibv_devinfo -v`; RoCE: "
                                        "the interface's IP address and MTU)"))
        host = _host_memory(pv, pd, host_bytes, what, limit, a.max_mr_size, done) if host_bytes else []
        problems += host
        gpudirect = ""
        if gpu is not None:
            gpudirect, gpu_notes = _gpudirect(pv, pd, gpu)
            notes += gpu_notes
        return DeviceReport(**report, problems=tuple(problems), notes=tuple(notes), checks=tuple(done),
                            ports=tuple(ports), attrs=attrs, host_bytes=0 if host else host_bytes,
                            gpudirect=gpudirect)
    except pv.pyverbs_error.PyverbsError as e:
        problems.append(checks.resource_problem("a basic verbs call", _err(pv, e)[1]))
        return DeviceReport(**report, problems=tuple(problems), notes=tuple(notes), checks=tuple(done))
    finally:
        ctx.close()  # closes every object made on it


def _host_memory(pv, pd, nbytes: int, what: str, limit: int | None, max_mr_size: int,
                 done: list) -> list[Problem]:
    p = checks.memlock_problem(nbytes, limit, what) or checks.mr_size_problem(nbytes, max_mr_size, what)
    if p is not None:
        return [p]
    e = pv.enums
    try:
        pv.mr.MR(pd, nbytes, e.IBV_ACCESS_LOCAL_WRITE | e.IBV_ACCESS_REMOTE_WRITE).close()
    except pv.pyverbs_error.PyverbsError as err:
        code, text = _err(pv, err)
        return [checks.registration_problem(code, nbytes, limit, what, text)]
    done.append(f"registered {what}: {nbytes / 2**20:.1f} MiB of host memory")
    return []


def _gpudirect(pv, pd, gpu: DeviceMemory) -> tuple[str, list[str]]:
    e = pv.enums
    access = e.IBV_ACCESS_LOCAL_WRITE | e.IBV_ACCESS_REMOTE_WRITE

    def as_oserror(fn):
        try:
            fn().close()
        except pv.pyverbs_error.PyverbsError as err:
            code, text = _err(pv, err)
            raise OSError(code, text) from None

    r = try_gpudirect(gpu, lambda fd, n, iova: as_oserror(lambda: pv.mr.DmaBufMR(pd, n, access, dmabuf=fd)),
                      lambda ptr, n: as_oserror(lambda: pv.mr.MR(pd, n, access, address=ptr)))
    return f"{r.label}: {r.summary}", [f"GPUDirect {r.label}: {f}" for f in r.failures]
