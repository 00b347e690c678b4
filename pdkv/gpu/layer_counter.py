"""The layer counter: how far the forward pass has got, readable without the GIL.

The messenger's C poller watches one 64-bit integer in host memory (``host_address``) and posts
a layer's page writes once the counter reaches that layer's target. Semantics, the same for
every implementation:

- starts at 0, is bumped by exactly 1 after each layer's attention output projection (under
  tensor parallelism: after its all-reduce, on rank 0 only -- the all-reduce means every rank
  has finished appending that layer's KV), and is never reset;
- so a forward step over L layers moves it from b to b + L; the model runner, which issues every
  bump, queues layer i's writes with target b + i + 1;
- the bump is a release: whoever reads the new value (acquire) also sees the KV entries the
  layer wrote before it.

Two implementations behind :func:`make_layer_counter`:

``CudaLayerCounter`` -- the integer lives in pinned host memory mapped into the GPU's address
space (``cuMemHostAlloc(DEVICEMAP | PORTABLE)``). ``bump()`` enqueues a one-element kernel on
the current CUDA stream over the device-mapped pointer; a kernel is captured by CUDA graphs like
any other, and each replay reads and increments the value, so the counter keeps counting across
replays. (Stream memory operations such as ``cuStreamWriteValue64`` are capturable too, but write
a constant fixed at capture time: every replay would write the same values.) Two kernels, named
by :class:`BumpKind` and reported as ``counter.bump_kind``:

- ``TRITON_RELEASE_SYS`` (preferred): ``tl.atomic_add(ptr, 1, sem="release", scope="sys")``
  (``pdkv.gpu.release_bump``), a release at system scope, so the layer's KV writes are visible to
  the host and the NIC before the new value is;
- ``TORCH_ADD`` (fallback where Triton is missing or cannot compile): torch's ``add_(1)``,
  ordered after the layer only by the kernel boundary. ``counter.bump_fallback_reason`` says why.

``bump="auto"`` (the default) picks Triton when it works and falls back with a logged warning;
``bump="triton"`` refuses to fall back; ``bump="torch"`` forces the fallback (for comparisons).

``CpuLayerCounter`` -- a plain int64 in process memory; ``bump()`` increments it right away
from the model runner's thread (an atomic release add via libatomic; on x86-64 without
libatomic a plain aligned store, which is already a release under x86's memory order).
"""

from __future__ import annotations

import ctypes
import enum
import logging
import platform
from typing import Callable, Protocol

log = logging.getLogger(__name__)


class BumpKind(enum.Enum):
    TRITON_RELEASE_SYS = "triton atomic_add(sem=release, scope=sys)"
    TORCH_ADD = "torch add_(1) (ordered by the kernel boundary only)"
    CPU_ATOMIC = "host atomic fetch_add (release)"


BUMP_CHOICES = ("auto", "triton", "torch")


def choose_bump(requested: str, load_triton: Callable[[], Callable]) -> tuple[BumpKind, Callable | None, str | None]:
    """Which kernel bumps a CUDA counter: ``(kind, triton bump function or None, fallback reason)``.

    ``load_triton`` imports ``pdkv.gpu.release_bump``, compiles and test-runs it, and returns its
    ``bump``; any exception it raises is the reason for falling back (``"auto"``) or the error
    (``"triton"``)."""
    if requested not in BUMP_CHOICES:
        raise ValueError(f"CudaLayerCounter: bump must be one of {', '.join(BUMP_CHOICES)}, got {requested!r}")
    if requested == "torch":
        return BumpKind.TORCH_ADD, None, "bump='torch' was asked for"
    try:
        return BumpKind.TRITON_RELEASE_SYS, load_triton(), None
    except Exception as e:  # noqa: BLE001 - ImportError, compiler errors, a failed test run
        reason = f"{type(e).__name__}: {e}"
        if requested == "triton":
            raise RuntimeError(f"CudaLayerCounter(bump='triton'): the Triton release bump is not "
                               f"usable here ({reason}); install triton or use bump='auto'") from e
        log.warning("CudaLayerCounter: falling back to torch add_(1) for the layer counter bump, "
                    "which is not a system-scope release (%s)", reason)
        return BumpKind.TORCH_ADD, None, reason


class LayerCounter(Protocol):
    host_address: int  # address of the int64 the poller reads (acquire), valid until close()

    def bump(self) -> None: ...  # +1 after one layer (GPU: enqueued on the current stream)

    def value(self) -> int: ...  # the value as the host sees it now

    def close(self) -> None: ...


def _atomic_add():
    """libatomic's ``__atomic_fetch_add_8`` as a ctypes function, or None if there is none."""
    try:
        lib = ctypes.CDLL("libatomic.so.1")
    except OSError:
        return None
    fn = lib.__atomic_fetch_add_8
    fn.restype, fn.argtypes = ctypes.c_int64, [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int]
    return fn


_RELEASE = 3  # __ATOMIC_RELEASE


class CpuLayerCounter:
    """The counter for CPU model runners: bumped directly, no device involved."""

    device = "cpu"
    bump_kind = BumpKind.CPU_ATOMIC
    bump_fallback_reason = None

    def __init__(self, address: int | None = None):
        """``address``: an int64 in memory another process maps too (a data-parallel prefill
        rank's counter, which the group's front watches: pdkv/dp/remote.py); None: its own."""
        self._cell = ctypes.c_int64(0) if address is None else ctypes.c_int64.from_address(address)
        self.host_address = ctypes.addressof(self._cell)
        self._add = _atomic_add()
        if self._add is None and platform.machine() not in ("x86_64", "AMD64", "i686"):
            raise RuntimeError(f"CpuLayerCounter on {platform.machine()} needs libatomic.so.1 "
                               "for a release increment (Debian: apt-get install libatomic1)")

    def bump(self) -> None:
        if self._add is not None:
            self._add(self.host_address, 1, _RELEASE)
        else:
            self._cell.value += 1  # x86-64: an aligned 8-byte store, release by TSO

    def value(self) -> int:
        return self._cell.value

    def close(self) -> None:
        pass  # the memory is the object's own; the poller must unwatch before it is dropped


class CudaLayerCounter:
    """The counter for CUDA model runners; ``bump()`` is safe inside CUDA graph capture."""

    def __init__(self, device: int = 0, bump: str = "auto"):
        from pdkv.gpu.guard import PrimaryContext, call, cuda_driver, require_numpy, require_torch_cuda

        if bump not in BUMP_CHOICES:
            raise ValueError(f"CudaLayerCounter: bump must be one of {', '.join(BUMP_CHOICES)}, got {bump!r}")
        drv = cuda_driver("CudaLayerCounter", device)
        torch = require_torch_cuda("CudaLayerCounter", device)
        require_numpy("CudaLayerCounter")
        self.device = f"cuda:{device}"
        self._drv, self._ctx = drv, PrimaryContext(drv, device)
        try:
            with self._ctx:
                if not self._ctx.attribute(drv.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_CAN_MAP_HOST_MEMORY):
                    raise RuntimeError(f"cuda:{device} cannot map host memory; no CUDA layer counter")
                flags = drv.CU_MEMHOSTALLOC_DEVICEMAP | drv.CU_MEMHOSTALLOC_PORTABLE
                self.host_address = int(call(drv, drv.cuMemHostAlloc, 8, flags))
                try:
                    dev_ptr = int(call(drv, drv.cuMemHostGetDevicePointer, self.host_address, 0))
                except BaseException:
                    drv.cuMemFreeHost(self.host_address)
                    raise
        except BaseException:
            self._ctx.release()
            raise
        self._cell = ctypes.c_int64.from_address(self.host_address)
        self._cell.value = 0
        self.device_address = dev_ptr  # equals host_address on every UVA system (all 64-bit ones)
        self._closed, self._dev, self._triton_bump = False, None, None
        try:
            with torch.cuda.device(device):
                # [1] int64 CUDA tensor over the mapped pinned word; its kernels write host memory.
                self._dev = torch.as_tensor(_MappedWord(dev_ptr))
            if self._dev.data_ptr() != dev_ptr or self._dev.device != torch.device("cuda", device):
                raise RuntimeError(f"CudaLayerCounter: torch put the counter at {self._dev.device}@"
                                   f"{self._dev.data_ptr():#x}, expected cuda:{device}@{dev_ptr:#x}; "
                                   "bumps would not reach the host word")
            self.bump_kind, self._triton_bump, self.bump_fallback_reason = choose_bump(
                bump, lambda: self._load_triton(torch, device))
            if self._triton_bump is None:
                self._first_bump(torch, device, lambda: self._dev.add_(1))
        except BaseException:
            self.close()
            raise

    def _load_triton(self, torch, device: int):
        fn = _load_triton_bump(torch.device("cuda", device))
        self._first_bump(torch, device, lambda: fn(self._dev))
        return fn

    def _first_bump(self, torch, device: int, bump) -> None:
        """Run the chosen kernel once on this very word, then set it back to 0 (nobody watches
        it yet): a later graph capture then never compiles or (lazily) loads a module, and a
        kernel that does not add exactly 1 is caught here."""
        with torch.cuda.device(device):
            bump()
        torch.cuda.synchronize(device)
        got, self._cell.value = self._cell.value, 0
        if got != 1:
            raise RuntimeError(f"CudaLayerCounter: one bump moved the mapped counter to {got}, expected 1")

    def bump(self) -> None:
        """Enqueue +1 on the current stream (captured into a CUDA graph when capturing)."""
        if self._triton_bump is not None:
            self._triton_bump(self._dev)
        else:
            self._dev.add_(1)

    def value(self) -> int:
        return self._cell.value

    def close(self) -> None:
        """Free the pinned word. Destroy CUDA graphs that bump it first: a replay after close
        would write freed memory."""
        if self._closed:
            return
        self._closed = True
        import torch

        torch.cuda.synchronize(self.device)
        self._dev = None
        with self._ctx:
            self._drv.cuMemFreeHost(self.host_address)
        self._ctx.release()


def _load_triton_bump(device):
    from pdkv.gpu import release_bump  # imports triton; ImportError -> fallback

    release_bump.warm_up(device)  # compile now: a CUDA graph capture must never compile
    return release_bump.bump


class _MappedWord:
    """``__cuda_array_interface__`` for one int64 at a device-mapped host address."""

    def __init__(self, ptr: int):
        self.__cuda_array_interface__ = {"shape": (1,), "typestr": "<i8", "data": (ptr, False),
                                         "strides": None, "version": 3}


def make_layer_counter(device, bump: str = "auto") -> LayerCounter:
    """The counter for a model on ``device`` ("cpu", "cuda", "cuda:1", or a torch.device);
    ``bump`` chooses the CUDA kernel (see the module docstring; ignored on the CPU)."""
    text = str(device)
    if text == "cpu":
        return CpuLayerCounter()
    if text == "cuda" or text.startswith("cuda:"):
        index = int(text.split(":", 1)[1]) if ":" in text else 0
        return CudaLayerCounter(index, bump)
    raise ValueError(f"make_layer_counter: device must be 'cpu' or 'cuda[:N]', got {text!r}")
