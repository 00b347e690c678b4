"""GPUDirect registration: which way is taken, and what the error says when none works.

The driver and the NIC are fault-injection fakes (callables that return a key or raise as the
real calls do); the host facts come from captured /sys and /proc trees under tmp_path, and once
from this machine's real ones.
"""

from __future__ import annotations

import errno
import os

import pytest

from pdkv.gpu.gpudirect import (GPUDirectUnavailable, HostFacts, Method, gpudirect_possible,
                                host_gpudirect_facts, is_unsupported, register_device_memory)
from pdkv.gpu.guard import CudaError

OPEN = "NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  570.124.06  Release Build\n"
PROPRIETARY = "NVRM version: NVIDIA UNIX x86_64 Kernel Module  550.54.15  Tue Mar  5 22:23:56 UTC 2024\n"


def _host(tmp_path, kernel="6.8.0-49-generic", nvidia=OPEN, peermem=None):
    sys_root, proc_root = tmp_path / "sys", tmp_path / "proc"
    (proc_root / "sys/kernel").mkdir(parents=True)
    (proc_root / "sys/kernel/osrelease").write_text(kernel + "\n")
    if nvidia is not None:
        (proc_root / "driver/nvidia").mkdir(parents=True)
        (proc_root / "driver/nvidia/version").write_text(nvidia)
    (sys_root / "module/nvidia").mkdir(parents=True)
    if peermem:
        (sys_root / "module" / peermem).mkdir()
    return host_gpudirect_facts(str(sys_root), str(proc_root))


def test_host_facts_are_read_from_sysfs_and_procfs(tmp_path):
    assert _host(tmp_path / "a") == HostFacts((6, 8), "open", None)
    assert _host(tmp_path / "b", "5.4.0-150-generic", PROPRIETARY, "nv_peer_mem") == \
        HostFacts((5, 4), "proprietary", "nv_peer_mem")
    assert _host(tmp_path / "c", nvidia=None, peermem="nvidia_peermem") == HostFacts((6, 8), "absent", "nvidia_peermem")


def test_this_machines_facts_can_be_read():
    facts = host_gpudirect_facts()
    assert facts.kernel >= (3, 0) and facts.nvidia_module in ("open", "proprietary", "absent")


class Nic:
    """Fault injection: a NIC whose two registration calls succeed or fail as told."""

    def __init__(self, dmabuf_error=None, mr_error=None):
        self.dmabuf_error, self.mr_error, self.calls = dmabuf_error, mr_error, []

    def reg_dmabuf(self, fd, offset, length, iova):
        self.calls.append(("reg_dmabuf", offset, length, iova))
        os.fstat(fd)  # the fd must still be open while it is registered
        if self.dmabuf_error:
            raise self.dmabuf_error
        return "dmabuf-key"

    def reg_mr(self, ptr, length):
        self.calls.append(("reg_mr", ptr, length))
        if self.mr_error:
            raise self.mr_error
        return "mr-key"


class Exporter:
    """Fault injection: cuMemGetHandleForAddressRange giving a real fd (a pipe end) or failing."""

    def __init__(self, error=None):
        self.error, self.fds = error, []

    def __call__(self, ptr, nbytes, device):
        if self.error:
            raise self.error
        r, w = os.pipe()
        os.close(w)
        self.fds.append(r)
        return r

    def all_closed(self) -> bool:
        def closed(fd):
            try:
                os.fstat(fd)
                return False
            except OSError:
                return True
        return all(closed(fd) for fd in self.fds)


PTR, N = 0x7F0000000000, 64 << 20
NOT_SUPPORTED = CudaError("cuMemGetHandleForAddressRange(...) failed: CUDA_ERROR_NOT_SUPPORTED", 801)


def test_dmabuf_is_preferred_and_its_fd_closed_after_registration():
    nic, export = Nic(), Exporter()
    reg = register_device_memory(PTR, N, 0, reg_dmabuf=nic.reg_dmabuf, reg_mr=nic.reg_mr, get_dmabuf_fd=export,
                                 facts=HostFacts((6, 8), "open", "nvidia_peermem"))
    assert reg.method is Method.DMABUF and reg.key == "dmabuf-key"
    assert nic.calls == [("reg_dmabuf", 0, N, PTR)] and export.all_closed()


@pytest.mark.parametrize("export_error, dmabuf_error", [
    (NOT_SUPPORTED, None),
    (None, OSError(errno.EOPNOTSUPP, "Operation not supported")),
])
def test_peermem_is_the_fallback(export_error, dmabuf_error):
    nic, export = Nic(dmabuf_error=dmabuf_error), Exporter(export_error)
    reg = register_device_memory(PTR, N, 1, reg_dmabuf=nic.reg_dmabuf, reg_mr=nic.reg_mr, get_dmabuf_fd=export,
                                 facts=HostFacts((6, 8), "proprietary", "nvidia_peermem"))
    assert reg.method is Method.PEERMEM and reg.key == "mr-key" and nic.calls[-1] == ("reg_mr", PTR, N)
    assert export.all_closed()


def test_when_neither_works_the_error_names_both_attempts_and_what_the_host_lacks():
    nic, export = Nic(), Exporter(NOT_SUPPORTED)
    with pytest.raises(GPUDirectUnavailable) as e:
        register_device_memory(PTR, N, 0, reg_dmabuf=nic.reg_dmabuf, reg_mr=nic.reg_mr, get_dmabuf_fd=export,
                               facts=HostFacts((5, 4), "proprietary", None))
    msg = str(e.value)
    assert msg.startswith(f"cannot register {N} bytes of cuda:0 memory at {PTR:#x} with the NIC (GPUDirect RDMA): ")
    assert "dma-buf: cuMemGetHandleForAddressRange(DMA_BUF_FD) failed: " in msg and "CUDA_ERROR_NOT_SUPPORTED" in msg
    assert "nvidia-peermem: ibv_reg_mr on the device pointer not attempted: the module is not loaded" in msg
    assert "dma-buf needs Linux >= 5.12, this is 5.4" in msg
    assert "dma-buf needs NVIDIA's open kernel module, this host runs the proprietary one" in msg
    assert "nvidia-peermem is not loaded (no /sys/module/nvidia_peermem; `modprobe nvidia-peermem`)" in msg
    assert nic.calls == []  # nothing registered half-way


def test_a_loaded_peermem_that_fails_is_named_with_the_nic_error():
    nic = Nic(dmabuf_error=OSError(errno.EINVAL, "Invalid argument"), mr_error=OSError(errno.EFAULT, "Bad address"))
    export = Exporter()
    with pytest.raises(GPUDirectUnavailable, match=r"ibv_reg_dmabuf_mr on the fd failed: \[Errno 22\] Invalid argument; "
                       r"nvidia-peermem \(nvidia_peermem loaded\): ibv_reg_mr on the device pointer failed: "
                       r"\[Errno 14\] Bad address\. This host lacks: nothing known"):
        register_device_memory(PTR, N, 0, reg_dmabuf=nic.reg_dmabuf, reg_mr=nic.reg_mr, get_dmabuf_fd=export,
                               facts=HostFacts((6, 8), "open", "nvidia_peermem"))
    assert export.all_closed()


def test_without_a_gpu_the_dmabuf_attempt_says_so(monkeypatch):
    nic = Nic()
    with pytest.raises(GPUDirectUnavailable, match=r"dma-buf: cuMemGetHandleForAddressRange\(DMA_BUF_FD\) failed: "
                                                   r"dmabuf_fd_for_range needs a GPU"):
        register_device_memory(PTR, N, 0, reg_dmabuf=nic.reg_dmabuf, reg_mr=nic.reg_mr,
                               facts=HostFacts((6, 8), "absent", None))


def test_which_hosts_can_do_gpudirect_at_all():
    assert gpudirect_possible(HostFacts((6, 8), "open", None)) == (True, "")
    assert gpudirect_possible(HostFacts((5, 4), "proprietary", "nvidia_peermem")) == (True, "")
    ok, why = gpudirect_possible(HostFacts((6, 8), "proprietary", None))
    assert not ok and "open kernel module" in why and "nvidia-peermem is not loaded" in why


def test_unsupported_dmabuf_errors_are_told_apart_from_real_failures():
    assert is_unsupported(NOT_SUPPORTED) and is_unsupported(CudaError("x", 500)) and is_unsupported(CudaError("x", 1))
    assert not is_unsupported(CudaError("out of memory", 2)) and not is_unsupported(RuntimeError("x"))


def test_misaligned_ranges_are_refused_before_the_driver():
    from pdkv.gpu.gpudirect import dmabuf_fd_for_range

    with pytest.raises(ValueError, match="multiples of the host page size"):
        dmabuf_fd_for_range(PTR + 1, N)
