"""GPU-only building blocks: cuMem KV memory shared across processes, the CUDA layer counter.

Importing this package (or any module in it) never imports cuda-python nor initialises CUDA:
that happens on the first call that needs it, which raises :class:`GPUUnavailable` naming what
is missing (cuda-python, the NVIDIA driver, or a device) on machines without a GPU.

  CuMemAllocation   pdkv.gpu.cumem          cuMemCreate/Map + export/import of POSIX fds
  CuMemInfo         pdkv.gpu.cumem          what an importer needs besides the fd
  send_fd, recv_fd, pidfd_getfd  pdkv.gpu.fdpass   moving descriptors between processes
  make_layer_counter, CpuLayerCounter, CudaLayerCounter  pdkv.gpu.layer_counter
"""

from __future__ import annotations

import importlib

from pdkv.gpu.guard import CudaError, GPUUnavailable, gpu_unavailable_reason

_LAZY = {
    "CuMemAllocation": "pdkv.gpu.cumem",
    "CuMemInfo": "pdkv.gpu.cumem",
    "send_fd": "pdkv.gpu.fdpass",
    "recv_fd": "pdkv.gpu.fdpass",
    "pidfd_getfd": "pdkv.gpu.fdpass",
    "FdPassError": "pdkv.gpu.fdpass",
    "LayerCounter": "pdkv.gpu.layer_counter",
    "CpuLayerCounter": "pdkv.gpu.layer_counter",
    "CudaLayerCounter": "pdkv.gpu.layer_counter",
    "make_layer_counter": "pdkv.gpu.layer_counter",
}

__all__ = ["CudaError", "GPUUnavailable", "gpu_unavailable_reason", *_LAZY]


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'pdkv.gpu' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
