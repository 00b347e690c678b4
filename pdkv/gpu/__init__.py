"""GPU-only building blocks: cuMem KV memory shared across processes, the CUDA layer counter.

Importing this package (or any module in it) never imports cuda-python nor initialises CUDA:
that happens on the first call that needs it, which raises :class:`GPUUnavailable` naming what
is missing (cuda-python, the NVIDIA driver, or a device) on machines without a GPU. Import what
you use from its module:

  CuMemAllocation, CuMemInfo                     pdkv.gpu.cumem   cuMemCreate/Map + export/import of fds
  send_fd, recv_fd, pidfd_getfd                  pdkv.gpu.fdpass   moving descriptors between processes
  make_layer_counter, CpuLayerCounter, CudaLayerCounter  pdkv.gpu.layer_counter
  StagingRing, Span, split_spans                 pdkv.gpu.staging   the bounded pinned staging ring
  make_copy_engine, CopyResult, CopyStatus       pdkv.gpu.copy_engine   device<->staging copies
  CpuCopyEngine / CudaCopyEngine                 pdkv.gpu.cpu_copy_engine / cuda_copy_engine
  register_device_memory, host_gpudirect_facts   pdkv.gpu.gpudirect   dma-buf or peermem for verbs
"""

from __future__ import annotations

from pdkv.gpu.guard import CudaError, GPUUnavailable, gpu_unavailable_reason

__all__ = ["CudaError", "GPUUnavailable", "gpu_unavailable_reason"]
