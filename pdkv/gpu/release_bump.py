"""The layer counter's bump as a system-scope release: one Triton atomic, capturable by CUDA graphs.

Imported only by :class:`pdkv.gpu.layer_counter.CudaLayerCounter` (it imports Triton at the top).

Why not a plain torch ``add_(1)``: that kernel's store is ordered after the layer's KV writes only
by the kernel boundary, and CUDA documents kernel boundaries as ordering for later work on the
device, not for an observer on the host or a NIC reading over PCIe. NCCL issues
``__threadfence_system()`` before the flags its proxy thread polls for the same reason. Here the
increment itself is ``atom.add.release.sys`` (``tl.atomic_add(..., sem="release", scope="sys")``):
every write that happens before it -- including the previous kernels' writes, which the release is
cumulative over -- is visible system-wide before the new counter value is.

Under CUDA graph capture the launch is recorded like any kernel, and each replay performs the
read-modify-write again, so the counter keeps counting across replays. The first launch compiles
the kernel (Triton JIT, cached on disk under ``~/.triton``); :func:`warm_up` does that on a scratch
word so capture never sees a compilation.

NOTE: GPU atomics on mapped host memory are atomic for the GPU only, not against host writes
(CUDA programming guide, "Mapped Memory"). Only the GPU ever writes the counter; the host reads.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _bump_kernel(counter_ptr):
    # one program, one thread's worth of work: counter += 1, a release at system scope
    tl.atomic_add(counter_ptr, 1, sem="release", scope="sys")


def bump(counter) -> None:
    """Enqueue ``counter[0] += 1`` (release, system scope) on the current stream.

    counter: [1] int64 tensor (CUDA, or CPU under ``TRITON_INTERPRET=1``)."""
    _bump_kernel[(1,)](counter, num_warps=1)  # the scalar atomic runs once per program anyway


def warm_up(device) -> None:
    """Compile and run the kernel once on a scratch word of ``device`` (outside any capture)."""
    import torch

    device = torch.device(device)
    scratch = torch.zeros(1, dtype=torch.int64, device=device)
    if device.type == "cuda":
        with torch.cuda.device(device):  # Triton launches on the current device's context
            bump(scratch)
    else:
        bump(scratch)  # the CPU only under TRITON_INTERPRET=1 (tests)
    got = int(scratch.item())  # synchronises: a broken kernel fails here, not in a graph
    if got != 1:
        raise RuntimeError(f"the Triton release bump added {got} to a zeroed word, expected 1")
