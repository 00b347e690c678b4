"""GPUDirect RDMA through one NIC: which way registers GPU memory, dma-buf or nvidia-peermem.

Both ways are tried on a small allocation of device memory (2 MiB, one cuMem granule):

- **dma-buf**: the CUDA driver exports the range as a dma-buf fd and the NIC imports it
  (``ibv_reg_dmabuf_mr``); needs Linux >= 5.12 and NVIDIA's open kernel module;
- **nvidia-peermem**: ``ibv_reg_mr`` on the device pointer, resolved by the peer-memory module.

The memory comes from a ``DeviceMemory``: :func:`cuda_memory` allocates it for real (behind
pdkv.gpu's checks, so a host without CUDA gets the reason, never an import error); the tests
hand in a stand-in whose "dma-buf" is a memfd and whose "device pointer" is an address this
process has not mapped, which the loopback verbs device treats as such.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable, Protocol

GPU_PROBE_BYTES = 2 << 20


class DeviceMemory(Protocol):
    label: str  # "cuda:0 (0000:1b:00.0)"
    ptr: int
    nbytes: int

    def dmabuf_fd(self) -> int: ...  # a new fd the caller closes; raises where it cannot export

    def close(self) -> None: ...


class _CudaMemory:
    def __init__(self, alloc):
        self._alloc = alloc
        self.ptr, self.nbytes = alloc.ptr, alloc.nbytes
        self.label = f"cuda:{alloc.device} ({alloc.bus_id})"

    def dmabuf_fd(self) -> int:
        return self._alloc.dmabuf_fd()

    def close(self) -> None:
        self._alloc.close()


def cuda_memory(ordinal: int = 0) -> tuple[DeviceMemory | None, str]:
    """(memory, "") on a host with a usable CUDA device, else (None, why not)."""
    from pdkv.gpu.guard import gpu_unavailable_reason  # noqa: PLC0415 - GPU hosts only

    reason = gpu_unavailable_reason(ordinal, need_torch=False)
    if reason is not None:
        return None, reason
    from pdkv.gpu.cumem import CuMemAllocation  # noqa: PLC0415

    try:
        return _CudaMemory(CuMemAllocation.allocate(GPU_PROBE_BYTES, ordinal)), ""
    except Exception as e:  # noqa: BLE001 - any driver failure is the answer here
        return None, f"cannot allocate {GPU_PROBE_BYTES >> 20} MiB on cuda:{ordinal}: {e}"


@dataclass(frozen=True)
class GpuDirectResult:
    methods: tuple[str, ...]  # the ways that registered: "dma-buf", "nvidia-peermem"
    failures: tuple[str, ...]  # what each way that did not said
    label: str

    @property
    def summary(self) -> str:
        return " and ".join(self.methods) if self.methods else "none"


def try_gpudirect(mem: DeviceMemory, reg_dmabuf: Callable[[int, int, int], None],
                  reg_peer: Callable[[int, int], None]) -> GpuDirectResult:
    """Both ways on ``mem``: ``reg_dmabuf(fd, nbytes, iova)`` and ``reg_peer(ptr, nbytes)``
    register and deregister (raising OSError with the errno on failure)."""
    methods, failures = [], []
    try:
        fd = mem.dmabuf_fd()
    except Exception as e:  # noqa: BLE001 - CudaError / OSError: the export is not possible here
        failures.append(f"dma-buf: the CUDA driver exported no dma-buf: {e}")
    else:
        try:
            reg_dmabuf(fd, mem.nbytes, mem.ptr)
            methods.append("dma-buf")
        except OSError as e:
            failures.append(f"dma-buf: ibv_reg_dmabuf_mr failed: {os.strerror(e.errno) if e.errno else e}")
        finally:
            os.close(fd)  # a registered MR holds its own reference
    try:
        reg_peer(mem.ptr, mem.nbytes)
        methods.append("nvidia-peermem")
    except OSError as e:
        failures.append(f"nvidia-peermem: ibv_reg_mr on the device pointer failed: "
                        f"{os.strerror(e.errno) if e.errno else e}")
    return GpuDirectResult(tuple(methods), tuple(failures), mem.label)


def lacks_text() -> str:
    """What this host lacks for GPUDirect, from /sys and /proc (pdkv.gpu.gpudirect)."""
    from pdkv.gpu.gpudirect import host_gpudirect_facts  # noqa: PLC0415

    lacks = host_gpudirect_facts().lacks()
    return "; ".join(lacks) if lacks else "nothing known: check `dmesg` for the NIC driver's messages"
