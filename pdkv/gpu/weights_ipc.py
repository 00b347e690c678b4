"""A model's weights in one cuMem allocation another process on the same GPU imports
(pdkv/shared_weights.py's ``memory: cumem``; the CPU's is a sealed memfd).

The owner packs every parameter storage into one allocation (device-to-device copies, then its
model is rebound to views of it and its private copy given back); each attaching process gets
its own POSIX handle (``cuMemExportToShareableHandle``) over the weights socket and maps it with
``cuMemImportFromShareableHandle`` (pdkv/gpu/cumem.py). The importer must compute on the GPU
that holds the memory (bus id compared; refused naming both, ValueError). Its interface (pack,
tensor, header, export_fd, settle, attach) is what pdkv.shared_weights asks of device memory.

If the owner dies the importer keeps working: its imported handle and mapping are references of
their own, and the driver frees the physical memory only when the last process has unmapped it
(tools/gpu_check_weights.py kills the owner with SIGKILL and computes again).
"""

from __future__ import annotations

from pdkv.gpu.cumem import CuMemAllocation, CuMemInfo


class CuMemWeights:
    kind = "cumem"

    def __init__(self, alloc: CuMemAllocation):
        self.alloc, self.size = alloc, alloc.size

    @classmethod
    def pack(cls, blobs, size: int) -> "CuMemWeights":
        """``blobs``: (offset, untyped CUDA storage) to copy in, all on one device."""
        import torch  # noqa: PLC0415

        device = blobs[0][1].device if blobs else torch.device("cuda", torch.cuda.current_device())
        alloc = CuMemAllocation.allocate(size, device.index or 0)
        flat = alloc.tensor()
        for off, st in blobs:
            flat[off:off + st.nbytes()].copy_(torch.empty(0, dtype=torch.uint8, device=device).set_(st))
        torch.cuda.synchronize(device)
        return cls(alloc)

    def tensor(self):
        """The packed bytes, flat ``uint8`` ``[size]`` on the device (no copy)."""
        return self.alloc.tensor()

    def header(self) -> dict:
        return self.alloc.info.to_header()

    def export_fd(self) -> int:
        return self.alloc.export_fd()

    def settle(self) -> None:
        import torch  # noqa: PLC0415

        torch.cuda.empty_cache()  # the private copy's blocks, cached by torch's allocator

    @classmethod
    def attach(cls, fd: int, header: dict, device: str) -> "CuMemWeights":
        """Import the owner's allocation; it must be on ``device`` (this process's GPU)."""
        import torch  # noqa: PLC0415

        info = CuMemInfo.from_header(header)
        alloc = CuMemAllocation.import_fd(fd, info)
        index = torch.device(device).index or 0
        if alloc.device != index:
            alloc.close()
            raise ValueError(f"shared weights are on the GPU at {info.bus_id} (cuda:{alloc.device} here), "
                                     f"this process computes on {device}: refused")
        return cls(alloc)

