"""KV-cache device memory from the CUDA virtual memory API, shareable between processes.

With tensor parallelism every rank holds its slice of the KV cache on its own GPU, but one
messenger in rank 0 posts all the page writes. So each rank allocates its cache with
``cuMemCreate`` asking for a POSIX-fd shareable handle, exports it
(``cuMemExportToShareableHandle``), passes the descriptor to rank 0 (SCM_RIGHTS, see
``fdpass``), and rank 0 imports it (``cuMemImportFromShareableHandle``) and maps it into its own
address space: rank 0 then has a device pointer to every rank's cache, to register with the NIC.

Steps for one allocation (both sides):  handle -> cuMemAddressReserve (VA range, aligned to the
granularity) -> cuMemMap(handle) -> cuMemSetAccess(read/write for the owning GPU). Close undoes
them in reverse: cuMemUnmap, cuMemAddressFree, cuMemRelease. The physical memory is freed when
the last process has unmapped it and released its handle.

As a torch tensor: :meth:`CuMemAllocation.tensor` hands torch an object with the
``__cuda_array_interface__`` (v3) over the mapped range; ``torch.as_tensor`` wraps that pointer
without copying (``at::from_blob``), finds the device from the pointer (cudaPointerGetAttributes)
and keeps the object alive as long as any view of the storage lives. The object holds the
allocation, so the mapping outlives every tensor made from it, and :meth:`close` refuses while
such tensors exist (unmapping under a live tensor would turn its next use into an illegal
address). The tensor is flat ``uint8``, ``[nbytes]``; ``.view(dtype)`` / ``KVCache(buffer=...)``
shape it.
"""

from __future__ import annotations

import os
import weakref
from dataclasses import dataclass

from pdkv.gpu.fdpass import recv_fd, send_fd
from pdkv.gpu.guard import CudaError, PrimaryContext, call, cuda_driver


@dataclass(frozen=True)
class CuMemInfo:
    """What an importer needs besides the descriptor."""

    nbytes: int  # mapped size: a multiple of the allocation granularity
    size: int  # bytes the owner asked for (<= nbytes)
    bus_id: str  # PCI bus id of the GPU holding the memory: ordinals differ between processes

    def to_header(self) -> dict:
        return {"nbytes": self.nbytes, "size": self.size, "bus_id": self.bus_id}

    @classmethod
    def from_header(cls, h: dict) -> "CuMemInfo":
        try:
            info = cls(int(h["nbytes"]), int(h["size"]), str(h["bus_id"]))
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"cuMem handle header lacks or garbles {e}: {h!r}") from None
        if not 0 < info.size <= info.nbytes:
            raise ValueError(f"cuMem handle header: size {info.size} must be in 1..nbytes ({info.nbytes})")
        return info


class _DeviceBytes:
    """``__cuda_array_interface__`` over [ptr, ptr + nbytes) as uint8; keeps its owner alive."""

    def __init__(self, owner: "CuMemAllocation", ptr: int, nbytes: int):
        self.owner = owner  # NOTE: torch holds this object until the storage dies -> mapping lives
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (ptr, False),
                                         "strides": None, "version": 3}


def _handle_type(drv):
    return drv.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR


def _prop(drv, ctx: PrimaryContext):
    prop = drv.CUmemAllocationProp()
    prop.type = drv.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
    prop.location.type = drv.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    prop.location.id = int(ctx.device)
    prop.requestedHandleTypes = _handle_type(drv)
    attr = drv.CUdevice_attribute
    # The NIC reads and writes this memory directly (GPUDirect RDMA); VMM allocations must ask.
    if ctx.attribute(attr.CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED):
        prop.allocFlags.gpuDirectRDMACapable = 1
    return prop


def _granularity(drv, prop) -> int:
    flag = drv.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_RECOMMENDED
    return int(call(drv, drv.cuMemGetAllocationGranularity, prop, flag))


def _map(drv, ctx: PrimaryContext, handle, nbytes: int, granularity: int) -> int:
    """Reserve a VA range, map ``handle`` there, grant the owning GPU read/write; returns ptr."""
    ptr = int(call(drv, drv.cuMemAddressReserve, nbytes, granularity, 0, 0))
    mapped = False
    try:
        call(drv, drv.cuMemMap, ptr, nbytes, 0, handle, 0)
        mapped = True
        desc = drv.CUmemAccessDesc()
        desc.location.type = drv.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        desc.location.id = int(ctx.device)
        desc.flags = drv.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        call(drv, drv.cuMemSetAccess, ptr, nbytes, [desc], 1)
    except BaseException:
        if mapped:
            drv.cuMemUnmap(ptr, nbytes)
        drv.cuMemAddressFree(ptr, nbytes)
        raise
    return ptr


def _release(drv, ctx: PrimaryContext, ptr: int, nbytes: int, handle) -> None:
    """Undo _map and the handle; every step runs even if an earlier one failed."""
    errors = []
    with ctx:
        for fn, args in ((drv.cuCtxSynchronize, ()),  # no kernel may still touch the range
                         (drv.cuMemUnmap, (ptr, nbytes)),
                         (drv.cuMemAddressFree, (ptr, nbytes)),
                         (drv.cuMemRelease, (handle,))):
            try:
                call(drv, fn, *args)
            except CudaError as e:
                errors.append(e)
    ctx.release()
    if errors:
        raise errors[0]


class CuMemAllocation:
    """One cuMem allocation mapped into this process (created here or imported from a peer).

    ``ptr`` is the device address of the mapping, ``nbytes`` its size (rounded up to the
    granularity), ``size`` the bytes asked for, ``device`` the owning GPU's ordinal *in this
    process*. Use :meth:`allocate` or :meth:`import_fd` (or :meth:`receive`), never the
    constructor.
    """

    def __init__(self, drv, ctx: PrimaryContext, handle, ptr: int, info: CuMemInfo, imported: bool):
        self._drv, self._ctx, self._handle = drv, ctx, handle
        self.ptr, self.nbytes, self.size = ptr, info.nbytes, info.size
        self.device, self.bus_id, self.imported = ctx.ordinal, info.bus_id, imported
        self._views: weakref.WeakSet[_DeviceBytes] = weakref.WeakSet()
        # Frees the mapping if the object is dropped without close(); close() runs it once.
        self._finalizer = weakref.finalize(self, _release, drv, ctx, ptr, info.nbytes, handle)
        self._finalizer.atexit = False  # at exit the driver frees it; CUDA may already be torn down

    @classmethod
    def allocate(cls, size: int, device: int = 0) -> "CuMemAllocation":
        """``size`` bytes (rounded up to the granularity, 2 MiB on current GPUs) on ``cuda:device``."""
        if int(size) < 1:
            raise ValueError(f"CuMemAllocation.allocate: size must be >= 1 byte, got {size}")
        drv = cuda_driver("CuMemAllocation.allocate", device)
        ctx = PrimaryContext(drv, device)
        try:
            with ctx:
                attr = drv.CUdevice_attribute
                for a, what in ((attr.CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED,
                                 "virtual memory management (cuMemCreate)"),
                                (attr.CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED,
                                 "POSIX file-descriptor handles (cuMemExportToShareableHandle)")):
                    if not ctx.attribute(a):
                        raise CudaError(f"cuda:{device} does not support {what}", 801)
                prop = _prop(drv, ctx)
                gran = _granularity(drv, prop)
                nbytes = -(-int(size) // gran) * gran
                handle = call(drv, drv.cuMemCreate, nbytes, prop, 0)
                try:
                    ptr = _map(drv, ctx, handle, nbytes, gran)
                except BaseException:
                    drv.cuMemRelease(handle)
                    raise
                info = CuMemInfo(nbytes, int(size), ctx.bus_id())
        except BaseException:
            ctx.release()
            raise
        return cls(drv, ctx, handle, ptr, info, imported=False)

    @classmethod
    def import_fd(cls, fd: int, info: CuMemInfo) -> "CuMemAllocation":
        """Map a peer's exported allocation. ``fd`` stays the caller's to close."""
        drv = cuda_driver("CuMemAllocation.import_fd")
        try:
            dev = call(drv, drv.cuDeviceGetByPCIBusId, info.bus_id.encode())
        except CudaError:
            raise CudaError(f"CuMemAllocation.import_fd: the GPU at {info.bus_id} that holds the "
                            "memory is not visible to this process (rank 0 must see every rank's "
                            "GPU: check CUDA_VISIBLE_DEVICES)", 101) from None
        ctx = PrimaryContext(drv, int(dev))
        try:
            with ctx:
                handle = call(drv, drv.cuMemImportFromShareableHandle, int(fd), _handle_type(drv))
                try:
                    gran = _granularity(drv, _prop(drv, ctx))
                    if info.nbytes % gran:
                        raise ValueError(f"CuMemAllocation.import_fd: nbytes {info.nbytes} is not a "
                                         f"multiple of the granularity {gran}")
                    ptr = _map(drv, ctx, handle, info.nbytes, gran)
                except BaseException:
                    drv.cuMemRelease(handle)
                    raise
        except BaseException:
            ctx.release()
            raise
        return cls(drv, ctx, handle, ptr, info, imported=True)

    @property
    def info(self) -> CuMemInfo:
        return CuMemInfo(self.nbytes, self.size, self.bus_id)

    def export_fd(self) -> int:
        """A new POSIX descriptor for this allocation; the caller closes it (after sending)."""
        self._check_open()
        return int(call(self._drv, self._drv.cuMemExportToShareableHandle, self._handle,
                        _handle_type(self._drv), 0))

    def dmabuf_fd(self) -> int:
        """A dma-buf descriptor for the whole mapped range, for ``ibv_reg_dmabuf_mr`` (GPUDirect
        RDMA without nvidia-peermem); the caller closes it. CudaError where the driver or device
        has no dma-buf support (older drivers, proprietary kernel modules)."""
        self._check_open()
        drv = self._drv
        with self._ctx:
            if not self._ctx.attribute(drv.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED):
                raise CudaError(f"cuda:{self.device} does not support dma-buf export "
                                "(CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED is 0)", 801)
            kind = drv.CUmemRangeHandleType.CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD
            return int(call(drv, drv.cuMemGetHandleForAddressRange, self.ptr, self.nbytes, kind, 0))

    def send(self, sock, rank: int) -> None:
        """Export and send to a peer over a Unix socket (SOCK_SEQPACKET); see :meth:`receive`."""
        fd = self.export_fd()
        try:
            send_fd(sock, fd, {"kind": "cumem", "rank": int(rank), **self.info.to_header()})
        finally:
            os.close(fd)  # the message carries its own reference

    @classmethod
    def receive(cls, sock) -> tuple[int, "CuMemAllocation"]:
        """Receive what a peer's :meth:`send` sent: ``(rank, allocation)``; no descriptor leaks."""
        fd, header = recv_fd(sock)
        try:
            if header.get("kind") != "cumem" or not isinstance(header.get("rank"), int):
                raise ValueError(f"CuMemAllocation.receive: not a cuMem handle message: {header!r}")
            return header["rank"], cls.import_fd(fd, CuMemInfo.from_header(header))
        finally:
            os.close(fd)  # the imported handle keeps the memory; the descriptor is not needed

    def tensor(self):
        """The first ``size`` bytes as a flat ``uint8`` CUDA tensor ``[size]`` (no copy)."""
        from pdkv.gpu.guard import require_numpy, require_torch_cuda

        self._check_open()
        torch = require_torch_cuda("CuMemAllocation.tensor", self.device)
        require_numpy("CuMemAllocation.tensor")
        view = _DeviceBytes(self, self.ptr, self.size)
        with torch.cuda.device(self.device):
            t = torch.as_tensor(view)
        if t.data_ptr() != self.ptr or t.device != torch.device("cuda", self.device):
            raise CudaError(f"torch wrapped {self.ptr:#x} as {t.device}@{t.data_ptr():#x}, expected "
                            f"cuda:{self.device}@{self.ptr:#x}", 1)
        self._views.add(view)
        return t

    @property
    def closed(self) -> bool:
        return not self._finalizer.alive

    def close(self) -> None:
        """Unmap and release. Refuses while tensors from :meth:`tensor` are alive."""
        if self.closed:
            return
        if len(self._views):
            raise RuntimeError(f"CuMemAllocation.close: {len(self._views)} tensor(s) over this memory "
                               "are still alive; drop them first (their next use would fault)")
        self._finalizer()

    def _check_open(self) -> None:
        if self.closed:
            raise ValueError("CuMemAllocation is closed")

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False

    def __repr__(self) -> str:
        state = "closed" if self.closed else f"ptr={self.ptr:#x}"
        return (f"CuMemAllocation({'imported' if self.imported else 'owned'}, cuda:{self.device} "
                f"[{self.bus_id}], size={self.size}, nbytes={self.nbytes}, {state})")
