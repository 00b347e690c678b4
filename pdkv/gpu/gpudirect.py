"""GPUDirect RDMA registration of GPU memory, decided on the Python side.

A NIC can read and write GPU memory directly in two ways, tried in this order:

1. **dma-buf**: the CUDA driver exports the range as a dma-buf fd
   (``cuMemGetHandleForAddressRange(..., CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD)``) and the verbs
   layer registers it with ``ibv_reg_dmabuf_mr(pd, offset, length, iova, fd, access)``. Needs
   Linux >= 5.12, rdma-core >= 34, and NVIDIA's *open* kernel module (R515+): the proprietary
   module does not export dma-bufs (the device attribute DMA_BUF_SUPPORTED is 0).
2. **nvidia-peermem**: plain ``ibv_reg_mr`` on the device pointer, which the kernel resolves
   through the ``nvidia_peermem`` module (or the older ``nv_peer_mem``) if it is loaded.

:func:`register_device_memory` runs both attempts through callables the transport supplies
(``reg_dmabuf(fd, offset, length, iova) -> key`` and ``reg_mr(ptr, length) -> key``, both
raising on failure) and returns a :class:`GpuRegistration`; when neither works it raises
:class:`GPUDirectUnavailable` naming both attempts and what this host lacks
(:func:`host_gpudirect_facts` reads that from /sys and /proc). The dma-buf fd is closed after
registration: the memory region holds its own reference to the dma-buf.

:func:`register_on_messenger` is the same through the messenger's C entry point
(``Messenger.register_device``: csrc/verbs_gpudirect.c tries ``ibv_reg_dmabuf_mr`` then
``ibv_reg_mr`` on every NIC, and keeps a dup of the fd for the registrations grants need later).

Wiring: the roles call ``register_on_messenger`` for each rank's cuMem range (rank 0
maps them all), and ``pdkv.config`` can refuse verbs with GPU memory up front when
``gpudirect_possible(host_gpudirect_facts())`` says neither way can work on this host.
"""

from __future__ import annotations

import enum
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from pdkv.gpu.guard import CudaError, GPUUnavailable

# CUresult codes that mean "this driver/module/device has no dma-buf export", not a bug:
# INVALID_VALUE (an older driver does not know the attribute or the handle type), NOT_FOUND (the
# entry point is missing from an older libcuda), NOT_PERMITTED, NOT_SUPPORTED.
DMABUF_UNSUPPORTED = {1: "CUDA_ERROR_INVALID_VALUE", 500: "CUDA_ERROR_NOT_FOUND",
                      800: "CUDA_ERROR_NOT_PERMITTED", 801: "CUDA_ERROR_NOT_SUPPORTED"}
PEERMEM_MODULES = ("nvidia_peermem", "nv_peer_mem")
MIN_KERNEL_DMABUF = (5, 12)


class GPUDirectUnavailable(GPUUnavailable):
    """Neither dma-buf nor nvidia-peermem can register this GPU memory with the NIC."""


class Method(enum.Enum):
    DMABUF = "ibv_reg_dmabuf_mr on a CUDA dma-buf fd"
    PEERMEM = "ibv_reg_mr on the device pointer (nvidia-peermem)"


@dataclass(frozen=True)
class GpuRegistration:
    method: Method
    key: object  # what the transport's registration returned (its region key)
    ptr: int
    nbytes: int


@dataclass(frozen=True)
class HostFacts:
    kernel: tuple[int, int]  # (major, minor) of the running Linux kernel
    nvidia_module: str  # "open", "proprietary" or "absent"
    peermem_module: str | None  # the loaded peer-memory module's name, or None

    def lacks(self) -> list[str]:
        """What this host lacks for each way, in words (empty: nothing known to be missing)."""
        out = []
        if self.kernel < MIN_KERNEL_DMABUF:
            out.append(f"dma-buf needs Linux >= 5.12, this is {self.kernel[0]}.{self.kernel[1]}")
        if self.nvidia_module == "proprietary":
            out.append("dma-buf needs NVIDIA's open kernel module, this host runs the proprietary one "
                       "(/proc/driver/nvidia/version)")
        elif self.nvidia_module == "absent":
            out.append("no NVIDIA kernel module is loaded (/proc/driver/nvidia/version is missing)")
        if self.peermem_module is None:
            out.append("nvidia-peermem is not loaded (no /sys/module/nvidia_peermem; `modprobe nvidia-peermem`)")
        return out


def host_gpudirect_facts(sys_root: str = "/sys", proc_root: str = "/proc") -> HostFacts:
    """Read what decides GPUDirect from sysfs and procfs (roots are parameters for tests)."""
    release = _read(Path(proc_root) / "sys/kernel/osrelease") or os.uname().release
    m = re.match(r"(\d+)\.(\d+)", release or "")
    kernel = (int(m.group(1)), int(m.group(2))) if m else (0, 0)
    version = _read(Path(proc_root) / "driver/nvidia/version")
    module = "absent" if version is None else ("open" if "Open Kernel Module" in version else "proprietary")
    peermem = next((name for name in PEERMEM_MODULES if (Path(sys_root) / "module" / name).is_dir()), None)
    return HostFacts(kernel, module, peermem)


def gpudirect_possible(facts: HostFacts) -> tuple[bool, str]:
    """(can some way work here, why not): for refusing verbs with GPU memory at start-up."""
    dmabuf = facts.kernel >= MIN_KERNEL_DMABUF and facts.nvidia_module == "open"
    if dmabuf or facts.peermem_module is not None:
        return True, ""
    return False, "; ".join(facts.lacks())


def dmabuf_fd_for_range(ptr: int, nbytes: int, device: int = 0) -> int:
    """A dma-buf fd for the device range [ptr, ptr + nbytes) (the caller closes it).

    The range must lie in one allocation (cuMemAlloc or a cuMemMap'ed reservation) and be aligned
    to the host page size. CudaError where the driver or device cannot export dma-bufs; see
    :func:`is_unsupported`."""
    from pdkv.gpu.guard import PrimaryContext, call, cuda_driver

    page = os.sysconf("SC_PAGE_SIZE")
    if ptr % page or nbytes % page or nbytes <= 0:
        raise ValueError(f"dma-buf export of {nbytes} bytes at {ptr:#x}: address and size must be "
                         f"positive multiples of the host page size ({page})")
    drv = cuda_driver("dmabuf_fd_for_range", device)
    ctx = PrimaryContext(drv, device)
    try:
        with ctx:
            if not ctx.attribute(drv.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED):
                raise CudaError(f"cuda:{device} does not support dma-buf export "
                                "(CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED is 0)", 801)
            kind = drv.CUmemRangeHandleType.CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD
            return int(call(drv, drv.cuMemGetHandleForAddressRange, ptr, nbytes, kind, 0))
    finally:
        ctx.release()


def is_unsupported(error: Exception) -> bool:
    """True when a dma-buf export failed because this host cannot do it (a SKIP, not a bug)."""
    return isinstance(error, CudaError) and error.code in DMABUF_UNSUPPORTED or isinstance(error, AttributeError)


def register_device_memory(ptr: int, nbytes: int, device: int, *, reg_dmabuf: Callable[[int, int, int, int], object],
                           reg_mr: Callable[[int, int], object],
                           get_dmabuf_fd: Callable[[int, int, int], int] = dmabuf_fd_for_range,
                           facts: HostFacts | None = None) -> GpuRegistration:
    """Register GPU memory with the NIC: dma-buf first, then nvidia-peermem (module docstring)."""
    facts = facts if facts is not None else host_gpudirect_facts()
    attempts = []
    try:
        fd = get_dmabuf_fd(ptr, nbytes, device)
    except (CudaError, GPUUnavailable, AttributeError, OSError) as e:
        attempts.append(f"dma-buf: cuMemGetHandleForAddressRange(DMA_BUF_FD) failed: {e}")
    else:
        try:
            return GpuRegistration(Method.DMABUF, reg_dmabuf(fd, 0, nbytes, ptr), ptr, nbytes)
        except OSError as e:
            attempts.append(f"dma-buf: ibv_reg_dmabuf_mr on the fd failed: {e}")
        finally:
            os.close(fd)  # a registered MR holds its own reference to the dma-buf
    if facts.peermem_module is None:
        attempts.append("nvidia-peermem: ibv_reg_mr on the device pointer not attempted: the module is not loaded")
    else:
        try:
            return GpuRegistration(Method.PEERMEM, reg_mr(ptr, nbytes), ptr, nbytes)
        except OSError as e:
            attempts.append(f"nvidia-peermem ({facts.peermem_module} loaded): ibv_reg_mr on the device "
                            f"pointer failed: {e}")
    lacks = facts.lacks() or ["nothing known: check `dmesg` for the NIC driver's messages"]
    raise GPUDirectUnavailable(
        f"cannot register {nbytes} bytes of cuda:{device} memory at {ptr:#x} with the NIC (GPUDirect "
        f"RDMA): {'; '.join(attempts)}. This host lacks: {'; '.join(lacks)}. Use a transport that "
        "stages through host memory (tcp) or fix one of these")


def register_on_messenger(messenger, ptr: int, nbytes: int, device: int, *,
                          get_dmabuf_fd: Callable[[int, int, int], int] = dmabuf_fd_for_range,
                          facts: HostFacts | None = None) -> GpuRegistration:
    """Register GPU memory with a verbs messenger's NICs through its C entry point
    (``Messenger.register_device``, csrc/verbs_gpudirect.c): the CUDA driver's dma-buf fd for the
    range (``ibv_reg_dmabuf_mr``), then the device pointer (``ibv_reg_mr``, nvidia-peermem), on
    every NIC of the transport. GPUDirectUnavailable naming both attempts (the export's failure,
    the C attempts' errno) and what this host lacks when neither works. The fd is closed here:
    the transport keeps its own dup for the registrations it makes later (grants, peer PDs)."""
    facts = facts if facts is not None else host_gpudirect_facts()
    fd, export = -1, ""
    try:
        fd = get_dmabuf_fd(ptr, nbytes, device)
    except (CudaError, GPUUnavailable, AttributeError, OSError, ValueError) as e:
        export = f"dma-buf: cuMemGetHandleForAddressRange(DMA_BUF_FD) failed: {e}; "
    try:
        key, how = messenger.register_device(fd, 0, nbytes, ptr)
    except OSError as e:
        lacks = facts.lacks() or ["nothing known: check `dmesg` for the NIC driver's messages"]
        raise GPUDirectUnavailable(
            f"cannot register {nbytes} bytes of cuda:{device} memory at {ptr:#x} with the NIC (GPUDirect "
            f"RDMA): {export}{e.strerror or e}. This host lacks: {'; '.join(lacks)}. Use a transport that "
            "stages through host memory (tcp) or fix one of these") from None
    finally:
        if fd >= 0:
            os.close(fd)
    return GpuRegistration(Method.DMABUF if how == "dmabuf" else Method.PEERMEM, key, ptr, nbytes)


def _read(path: Path) -> str | None:
    try:
        return path.read_text(errors="replace")
    except OSError:
        return None
