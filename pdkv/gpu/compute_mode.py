"""The GPU's compute mode: whether more than one process may use it at once.

The two-process cuMem check (and the disaggregated check, a prefill and a decode process on one
GPU) need mode Default. Under EXCLUSIVE_PROCESS the second process's context creation fails
with CUDA_ERROR_DEVICES_UNAVAILABLE, which says nothing about why; under PROHIBITED no process
gets a context. tools/gpu_check.py reads the mode first and skips those checks, naming the mode
and the command that changes it, instead of failing obscurely.

Two sources, the same names: the driver (``CU_DEVICE_ATTRIBUTE_COMPUTE_MODE``, a CUcomputemode)
and ``nvidia-smi --query-gpu=index,compute_mode --format=csv,noheader`` (which also works when a
CUDA context cannot be created).
"""

from __future__ import annotations

import subprocess

# CUcomputemode values (cuda.h); 1 (EXCLUSIVE_THREAD) was removed in CUDA 8 but old tools print it
COMPUTE_MODES = {0: "Default", 1: "Exclusive_Thread", 2: "Prohibited", 3: "Exclusive_Process"}
_BY_NAME = {name.lower(): name for name in COMPUTE_MODES.values()}
MULTI_PROCESS_OK = "Default"


def mode_name(value: int) -> str:
    return COMPUTE_MODES.get(int(value), f"unknown ({int(value)})")


def parse_nvidia_smi(text: str) -> dict[int, str]:
    """``{gpu index: mode}`` from ``nvidia-smi --query-gpu=index,compute_mode --format=csv,noheader``
    output ("0, Default" per line; names in any case, e.g. "E. Process" from older drivers)."""
    out = {}
    for line in text.splitlines():
        if not line.strip():
            continue
        index, sep, mode = line.partition(",")
        if not sep or not index.strip().isdigit():
            raise ValueError(f"nvidia-smi compute_mode: cannot read the line {line!r}")
        raw = mode.strip()
        key = raw.lower().replace(" ", "_")
        alias = {"e._process": "exclusive_process", "e._thread": "exclusive_thread"}.get(key, key)
        out[int(index)] = _BY_NAME.get(alias, raw)
    return out


def problem(mode: str) -> str | None:
    """None when several processes may share the GPU; else why not and how to change it."""
    if mode == MULTI_PROCESS_OK:
        return None
    return (f"the GPU's compute mode is {mode}: a second process cannot create a CUDA context on it "
            "(the two-process checks need Default; `sudo nvidia-smi -i <gpu> -c DEFAULT` changes it)")


def query_driver(device: int = 0) -> str:
    """The mode from the driver (needs cuda-python and a device)."""
    from pdkv.gpu.guard import PrimaryContext, cuda_driver

    drv = cuda_driver("compute_mode.query_driver", device)
    ctx = PrimaryContext(drv, device)
    try:
        return mode_name(ctx.attribute(drv.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_COMPUTE_MODE))
    finally:
        ctx.release()


def query_nvidia_smi(device: int = 0, timeout: float = 20.0) -> str | None:
    """The mode nvidia-smi reports for GPU ``device`` (its own numbering), or None without it."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=index,compute_mode", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if out.returncode != 0:
        return None
    return parse_nvidia_smi(out.stdout).get(device)
