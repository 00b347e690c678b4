"""GPU-only building blocks: cuMem KV memory shared across processes, the CUDA layer counter.

Importing this package (or any module in it) never imports cuda-python nor initialises CUDA:
that happens on the first call that needs it, which raises :class:`GPUUnavailable` naming what
is missing (cuda-python, the NVIDIA driver, or a device) on machines without a GPU.

  CuMemAllocation   pdkv.gpu.cumem          cuMemCreate/Map + export/import of POSIX fds
  CuMemInfo         pdkv.gpu.cumem          what an importer needs besides the fd
  send_fd, recv_fd, pidfd_getfd  pdkv.gpu.fdpass   moving descriptors between processes
  make_layer_counter, CpuLayerCounter, CudaLayerCounter  pdkv.gpu.layer_counter
  StagingRing, Span, split_spans                 pdkv.gpu.staging   the bounded pinned staging ring
  make_copy_engine, CopyResult, CopyStatus       pdkv.gpu.copy_engine   device<->staging copies
  CpuCopyEngine / CudaCopyEngine                 pdkv.gpu.cpu_copy_engine / cuda_copy_engine
  register_device_memory, host_gpudirect_facts   pdkv.gpu.gpudirect   dma-buf or peermem for verbs
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
    "StagingRing": "pdkv.gpu.staging",
    "Span": "pdkv.gpu.staging",
    "split_spans": "pdkv.gpu.staging",
    "make_copy_engine": "pdkv.gpu.copy_engine",
    "CopyResult": "pdkv.gpu.copy_engine",
    "CopyStatus": "pdkv.gpu.copy_engine",
    "Direction": "pdkv.gpu.copy_engine",
    "CpuCopyEngine": "pdkv.gpu.cpu_copy_engine",
    "CudaCopyEngine": "pdkv.gpu.cuda_copy_engine",
    "register_device_memory": "pdkv.gpu.gpudirect",
    "host_gpudirect_facts": "pdkv.gpu.gpudirect",
}

__all__ = ["CudaError", "GPUUnavailable", "gpu_unavailable_reason", *_LAZY]


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'pdkv.gpu' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
