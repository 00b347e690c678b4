"""The one door to CUDA: clear errors when something is missing, and checked driver calls.

Nothing here imports cuda-python or initialises CUDA at import time; every GPU entry point in
``pdkv.gpu`` calls :func:`cuda_driver` (driver API through cuda-python) or
:func:`require_torch_cuda` first, and on a machine without a GPU gets a :class:`GPUUnavailable`
that says which of the three things is missing:

  1. cuda-python (the ``cuda.bindings`` package) is not installed;
  2. no NVIDIA driver (``libcuda.so.1`` cannot be loaded);
  3. no CUDA device (cuInit says CUDA_ERROR_NO_DEVICE, or the ordinal asked for is not visible).

Two more checks run where they matter, because without them the first failure is far from its
cause: :func:`check_driver_version` (cuda-bindings 13 loads and even passes ``cuInit`` on a CUDA 12
driver, then fails on the first newer symbol) runs in :func:`cuda_driver` before ``cuInit``, and
:func:`require_numpy` (torch decodes ``__cuda_array_interface__`` through numpy) runs before any
``torch.as_tensor`` over a raw device pointer.

Driver calls go through :func:`call`, which turns cuda-python's ``(CUresult, *values)`` tuples
into values or a :class:`CudaError` naming the call, its arguments and the driver's error name.
"""

from __future__ import annotations

import ctypes
import enum
import importlib.metadata
import os

from pdkv.errors import PdkvError

# cuda-python returns the driver status as the first element of every call's tuple
CUDA_SUCCESS = 0
CUDA_ERROR_NO_DEVICE = 100

# Oldest Linux driver per CUDA major version (CUDA toolkit release notes, "minor version
# compatibility"): bindings of major M call symbols that only drivers of major >= M export.
MIN_DRIVER = {11: "450.80.02", 12: "525.60.13", 13: "580.65.06"}
# Oldest cuda-python per major that pdkv can use: 12.6 introduced ``cuda.bindings``.
MIN_BINDINGS = {11: "11.8", 12: "12.6", 13: "13.0"}


class GPUUnavailable(PdkvError, RuntimeError):
    """A GPU code path was called where it cannot run; the message names what is missing."""


class CudaError(PdkvError, RuntimeError):
    """A CUDA driver call failed; the message names the call and the driver's error."""

    def __init__(self, message: str, code: int):
        super().__init__(message)
        self.code = code


def _load_bindings():
    """cuda-python's driver module: ``cuda.bindings.driver`` (>= 12.6) or the older ``cuda.cuda``."""
    try:
        from cuda.bindings import driver
        return driver
    except ImportError:
        pass
    try:
        from cuda import cuda as driver  # cuda-python < 12.6 spelled it this way
        return driver
    except ImportError as e:
        raise GPUUnavailable(
            f"cuda-python is not installed ({e}); install it with `pip install cuda-python` "
            "(see docs/GPU.md)") from None


def _load_libcuda() -> None:
    # cuda-python loads the driver lazily and, when it is missing, fails deep inside with a
    # loader error; checking first gives the one-line reason.
    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError as e:
        raise GPUUnavailable(f"no NVIDIA driver: libcuda.so.1 cannot be loaded ({e})") from None


def bindings_version(drv=None) -> str:
    """The installed cuda-bindings (or, before 12.6, cuda-python) version, e.g. ``"13.4.4"``."""
    for dist in ("cuda-bindings", "cuda-python"):
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return str(getattr(drv, "__version__", "0"))


def check_driver_version(driver_version: int, bindings: str) -> None:
    """Refuse bindings newer than the driver, saying which ``cuda-python`` to install.

    ``driver_version`` is what ``cuDriverGetVersion`` returns (1000 * major + 10 * minor, e.g.
    12080 for CUDA 12.8); ``bindings`` is the cuda-bindings version string. Older bindings on a
    newer driver are fine (the driver keeps every old symbol), so only a higher bindings major
    is refused.
    """
    d_major, d_minor = driver_version // 1000, driver_version % 1000 // 10
    try:
        b_major = int(str(bindings).split(".", 1)[0])
    except ValueError:
        raise GPUUnavailable(f"cannot read the cuda-bindings version {bindings!r}; reinstall "
                             "cuda-python (see docs/GPU.md)") from None
    if b_major <= d_major:
        return
    low = MIN_BINDINGS.get(d_major, f"{d_major}.0")
    need = MIN_DRIVER.get(b_major, f"one for CUDA {b_major}")
    raise GPUUnavailable(
        f"cuda-bindings {bindings} is for CUDA {b_major} drivers (>= {need}), but this driver "
        f"supports CUDA {d_major}.{d_minor}: install the matching bindings with "
        f"`pip install \"cuda-python>={low},<{d_major + 1}\"`, or upgrade the NVIDIA driver to "
        f">= {need}")


def require_numpy(what: str = "this call") -> None:
    """torch decodes ``__cuda_array_interface__`` (typestr, shape) through numpy: without numpy,
    or with a numpy torch cannot talk to, ``torch.as_tensor`` over a device pointer fails with
    "Numpy is not available". Check first and name it."""
    try:
        import numpy
    except ImportError as e:
        raise GPUUnavailable(f"{what} needs numpy (torch reads __cuda_array_interface__ through "
                             f"it) but it cannot be imported ({e}); `pip install numpy`") from None
    import torch

    try:
        torch.from_numpy(numpy.zeros(1, dtype=numpy.int64))
    except (RuntimeError, TypeError, ValueError) as e:
        raise GPUUnavailable(f"{what} needs torch's numpy bridge, which fails with numpy "
                             f"{numpy.__version__} under torch {torch.__version__} ({e}); install a "
                             "numpy that this torch build supports") from None


def _visible() -> str:
    v = os.environ.get("CUDA_VISIBLE_DEVICES")
    return "unset" if v is None else repr(v)


def cuda_driver(what: str = "this call", device: int | None = None):
    """The cuda-python driver module, initialised; raises GPUUnavailable naming what is missing.

    ``what`` names the caller in the message (``"CuMemAllocation.allocate needs a GPU: ..."``);
    with ``device`` the ordinal is also checked against the devices this process can see.
    """
    prefix = f"{what} needs a GPU: "
    try:
        drv = _load_bindings()
        _load_libcuda()
    except GPUUnavailable as e:
        raise GPUUnavailable(prefix + str(e)) from None
    status, version = drv.cuDriverGetVersion()  # needs no cuInit; a mismatch fails later, obscurely
    if int(status) == CUDA_SUCCESS:
        try:
            check_driver_version(int(version), bindings_version(drv))
        except GPUUnavailable as e:
            raise GPUUnavailable(prefix + str(e)) from None
    err = drv.cuInit(0)[0]
    if int(err) != CUDA_SUCCESS:
        reason = "no CUDA device" if int(err) == CUDA_ERROR_NO_DEVICE else "the driver refused to start"
        raise GPUUnavailable(f"{prefix}{reason}: cuInit returned {error_name(drv, err)} "
                             f"(CUDA_VISIBLE_DEVICES={_visible()})")
    count = call(drv, drv.cuDeviceGetCount)
    if count == 0:
        raise GPUUnavailable(f"{prefix}no CUDA device is visible (CUDA_VISIBLE_DEVICES={_visible()})")
    if device is not None and not 0 <= device < count:
        raise GPUUnavailable(f"{prefix}cuda:{device} does not exist: {count} device(s) visible "
                             f"(CUDA_VISIBLE_DEVICES={_visible()})")
    return drv


def gpu_unavailable_reason(device: int = 0, need_torch: bool = True) -> str | None:
    """None when the GPU paths can run here (cuda-python, driver, device, and torch with CUDA);
    otherwise the reason, e.g. for ``pytest.mark.skipif``."""
    try:
        cuda_driver("pdkv.gpu", device)
        if need_torch:
            require_torch_cuda("pdkv.gpu", device)
            require_numpy("pdkv.gpu")
    except GPUUnavailable as e:
        return str(e)
    return None


def require_torch_cuda(what: str = "this call", device: int = 0):
    """``torch`` after checking it was built with CUDA and sees ``cuda:<device>``."""
    import torch

    prefix = f"{what} needs a GPU: "
    if torch.version.cuda is None:
        raise GPUUnavailable(f"{prefix}torch {torch.__version__} was built without CUDA "
                             "(torch.version.cuda is None); install a CUDA build of torch")
    if not torch.cuda.is_available():
        raise GPUUnavailable(f"{prefix}torch {torch.__version__} sees no CUDA device "
                             f"(CUDA_VISIBLE_DEVICES={_visible()})")
    if not 0 <= device < torch.cuda.device_count():
        raise GPUUnavailable(f"{prefix}cuda:{device} does not exist: torch sees "
                             f"{torch.cuda.device_count()} device(s)")
    return torch


def error_name(drv, err) -> str:
    try:
        status, name = drv.cuGetErrorName(err)
        if int(status) == CUDA_SUCCESS and name:
            return name.decode() if isinstance(name, bytes) else str(name)
    except Exception:  # noqa: BLE001 - naming an error must never hide the error itself
        pass
    return f"CUresult {int(err)}"


def call(drv, fn, *args):
    """Run one cuda-python driver call; returns its value(s) or raises CudaError.

    cuda-python returns ``(CUresult,)``, ``(CUresult, value)`` or ``(CUresult, v1, v2, ...)``.
    """
    out = fn(*args)
    err, rest = out[0], out[1:]
    if int(err) != CUDA_SUCCESS:
        shown = ", ".join(_short(a) for a in args)
        raise CudaError(f"{fn.__name__}({shown}) failed: {error_name(drv, err)}", int(err))
    if not rest:
        return None
    return rest[0] if len(rest) == 1 else rest


def _short(a) -> str:
    if isinstance(a, enum.Enum) or (isinstance(a, int) and isinstance(getattr(a, "name", None), str)):
        return a.name  # cuda-python's enums are int subclasses with a name, not enum.Enum
    if isinstance(a, int):
        return hex(a) if a >= 1 << 40 else str(a)  # device addresses in hex, sizes in decimal
    text = type(a).__name__
    return text if len(text) < 40 else text[:37] + "..."


class PrimaryContext:
    """A retained reference to device ``ordinal``'s primary context (the one torch uses).

    Driver calls that need a context run inside ``with ctx:``, which pushes it and pops it
    after, so the calling thread's current context (and torch's current device) is unchanged.
    NOTE: objects whose memory lives in this context hold one of these until they are freed,
    so the context cannot be destroyed under their mappings.
    """

    def __init__(self, drv, ordinal: int):
        self._drv = drv
        self.ordinal = ordinal
        self.device = call(drv, drv.cuDeviceGet, ordinal)
        self._ctx = call(drv, drv.cuDevicePrimaryCtxRetain, self.device)
        self._retained = True

    def __enter__(self):
        call(self._drv, self._drv.cuCtxPushCurrent, self._ctx)
        return self

    def __exit__(self, *exc):
        self._drv.cuCtxPopCurrent()
        return False

    def attribute(self, attr) -> int:
        return call(self._drv, self._drv.cuDeviceGetAttribute, attr, self.device)

    def bus_id(self) -> str:
        raw = call(self._drv, self._drv.cuDeviceGetPCIBusId, 32, self.device)
        text = raw.decode() if isinstance(raw, bytes) else str(raw)
        return text.split("\x00", 1)[0].strip()

    def release(self) -> None:
        if self._retained:
            self._retained = False
            self._drv.cuDevicePrimaryCtxRelease(self.device)
