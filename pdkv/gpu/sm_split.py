"""One GPU, two roles: the share of the GPU's SMs a role process may use (``parallel.gpu_sm_percent``).

A prefill and a decode process on one GPU otherwise compete for every SM, and a long prefill
stalls the decode steps as in a colocated engine. Two mechanisms bound a process's SMs:

- **MPS** (an ``nvidia-cuda-mps-control`` daemon serving this user): the client's
  ``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE``, read when the process creates its CUDA context, so it
  is set in the environment before anything touches CUDA (``apply`` refuses once torch has
  initialized CUDA). Chosen when the daemon's control pipe exists.
- **Green contexts** (CUDA 12.8+ driver, torch built with them:
  ``torch.cuda.green_contexts``): a context over a partition of the SMs; the kernels a thread
  launches while it is current run only there. ``enter_current_thread`` makes one current in
  the calling thread -- the engine thread calls it before its first step (pdkv/engine/loop.py),
  so every forward pass (and CUDA graph captured there) runs on the partition. SM counts are
  rounded down to the partition granularity (8 SMs from compute capability 9.0, else 2).

``plan`` is the decision, pure (tested on the CPU); ``apply`` acts on it. 0 (the default) and
100 leave the GPU whole. Nothing here imports torch's CUDA parts unless a green context is used.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

MPS_ENV = "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"
DEFAULT_MPS_PIPE = "/tmp/nvidia-mps"


class SMSplitError(RuntimeError):
    """The split that was asked for cannot be made here (which mechanism is missing, and how)."""


@dataclass(frozen=True)
class SMPlan:
    mechanism: str  # none | mps | green
    percent: int
    num_sms: int = 0  # green: the SMs of the partition


def mps_running(environ=os.environ) -> bool:
    """An MPS control daemon for this user: its pipe directory holds the ``control`` pipe."""
    pipe = Path(environ.get("CUDA_MPS_PIPE_DIRECTORY") or DEFAULT_MPS_PIPE)
    return (pipe / "control").exists()


def green_sms(total_sms: int, percent: int, major: int) -> int:
    """The SMs of a ``percent`` partition of ``total_sms``, rounded down to the granularity the
    driver splits by (at least one granule)."""
    granule = 8 if major >= 9 else 2
    return max(granule, (total_sms * percent // 100) // granule * granule)


def plan(percent: int, *, mps: bool, green: bool, total_sms: int = 0, major: int = 0,
         environ=os.environ) -> SMPlan:
    """Which mechanism makes a ``percent`` split: MPS when its daemon runs (it bounds the whole
    process, copies included), else a green context, else SMSplitError naming both."""
    if not 0 <= int(percent) <= 100:
        raise SMSplitError(f"parallel.gpu_sm_percent must be in 0..100, got {percent}")
    if percent in (0, 100):
        return SMPlan("none", int(percent))
    if mps:
        have = environ.get(MPS_ENV)
        if have not in (None, "", str(percent)):
            raise SMSplitError(f"{MPS_ENV}={have} is set in the environment, parallel.gpu_sm_percent says "
                               f"{percent}: unset one")
        return SMPlan("mps", int(percent))
    if green:
        return SMPlan("green", int(percent), green_sms(total_sms, int(percent), major))
    raise SMSplitError(f"parallel.gpu_sm_percent {percent} needs MPS (start `nvidia-cuda-mps-control -d`) "
                       "or CUDA green contexts (a 12.8+ driver and torch built with them); neither is here")


def probe(device: str, percent: int) -> SMPlan:
    """``plan`` for this machine: MPS from its pipe (no CUDA call, so its variable can still be
    set); green contexts and the SM count from torch only when MPS is not running."""
    if percent in (0, 100):
        return SMPlan("none", int(percent))
    if mps_running():
        return plan(percent, mps=True, green=False)
    import torch  # noqa: PLC0415 - GPU hosts only (a split was asked for on a cuda device)
    from torch.cuda import green_contexts  # noqa: PLC0415

    if not torch.cuda.is_available():
        raise SMSplitError(f"parallel.gpu_sm_percent {percent}: no CUDA device here for {device}")
    index = torch.device(device).index or 0
    props = torch.cuda.get_device_properties(index)
    return plan(percent, mps=False, green=bool(green_contexts.SUPPORTED), total_sms=props.multi_processor_count,
                major=props.major)


_active: SMPlan | None = None
_device_index = 0


def apply(p: SMPlan, device: str, environ=os.environ) -> None:
    """Act on ``p`` in this process (once, at start): MPS sets its variable (before CUDA is
    initialized, else SMSplitError); green records the plan for ``enter_current_thread``."""
    global _active, _device_index
    if p.mechanism == "mps":
        import sys  # noqa: PLC0415

        torch = sys.modules.get("torch")  # never imported here: only asked whether CUDA started
        if torch is not None and torch.cuda.is_initialized():
            raise SMSplitError(f"{MPS_ENV} must be set before CUDA is initialized in this process")
        environ[MPS_ENV] = str(p.percent)
    _device_index = int(device.split(":", 1)[1]) if ":" in device else 0
    _active = p


def enter_current_thread():
    """Green split: a green context over the planned SMs, current in the calling thread from now
    on (returned, and kept by the caller for as long as the thread runs). Else None."""
    if _active is None or _active.mechanism != "green":
        return None
    from torch.cuda.green_contexts import GreenContext  # noqa: PLC0415 - GPU hosts only

    ctx = GreenContext.create(num_sms=_active.num_sms, device_id=_device_index)
    # torch 2.13 names it set_context; earlier releases (2.8-2.11) make_current
    (getattr(ctx, "set_context", None) or ctx.make_current)()
    return ctx


def active() -> SMPlan | None:
    return _active
