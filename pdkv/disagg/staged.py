"""Which way KV pages travel on a node's data path, and the staging ring they go through.

The transports move host memory: tcp's receiver ``recv()``s into a registered region and its
sender ``send()``s from one; verbs registers memory with the NIC, which reaches GPU memory only
through GPUDirect RDMA (a dma-buf of the allocation, or nvidia-peermem). So a node whose KV
lives on a GPU either registers it with the NIC (GPUDirect) or stages it through pinned host
memory (pdkv/gpu/staging.py, copy_engine.py):

- prefill: when layer l is done, its pages are copied device-to-host into a slot of the ring,
  and the writes leave from the slot (pdkv/disagg/staged_prefill.py);
- decode: the writes land in slots of the ring, one page of every layer and rank per slot, and
  are copied host-to-device before the request is declared complete (staged_decode.py).

``messenger.staging`` picks (``staging_mode``): ``auto`` stages GPU KV unless verbs can
register it directly, and sends host KV directly; ``off`` never stages (tcp with GPU KV is
refused); ``cpu`` runs the very same pipeline on host KV through the CPU copy engine, so every
CPU test exercises it. Combinations that cannot work are refused when the node starts, naming
what is missing (no CUDA; verbs on GPU memory where the driver offers neither dma-buf nor peer
memory; a ring too small for one layer's write).
"""

from __future__ import annotations

import enum

from pdkv import transports
from pdkv.config import ConfigError
from pdkv.transports import Capability

MIB = 1 << 20


class StagingMode(enum.Enum):
    OFF = "off"  # host KV, registered and moved as it is
    CPU = "cpu"  # host KV through the CPU copy engine (the stand-in the CPU tests run)
    CUDA = "cuda"  # GPU KV through the CUDA copy engine and a pinned ring
    GPUDIRECT = "gpudirect"  # GPU KV registered with the NIC (verbs); nothing staged

    @property
    def staged(self) -> bool:
        return self in (StagingMode.CPU, StagingMode.CUDA)


def messenger_registers_gpu_memory() -> bool:
    """Whether this build's messenger can register device memory with the NIC (GPUDirect)."""
    from pdkv._messenger import Messenger  # noqa: PLC0415

    return hasattr(Messenger, "register_device")


def staging_mode(cfg, *, gpu_reason=None, gpudirect=None, can_register_gpu=None) -> StagingMode:
    """The mode for ``cfg`` on this host, or ConfigError naming the combination that cannot work.

    The probes are parameters so tests can play hosts this one is not: ``gpu_reason()`` -> None
    or why CUDA cannot run (pdkv.gpu.gpu_unavailable_reason); ``gpudirect()`` -> (possible, why
    not) (pdkv.gpu.gpudirect); ``can_register_gpu()`` -> whether the messenger registers GPU memory."""
    ms, device = cfg.messenger, cfg.model.device
    where = f"{cfg.source}: role {cfg.role} with model.device {device}"
    if device == "cpu":
        return StagingMode.CPU if ms.staging == "cpu" else StagingMode.OFF
    if ms.staging == "cpu":
        raise ConfigError(f"{where}: messenger.staging cpu runs the staging pipeline on host KV only; "
                          "use auto for GPU KV")
    if gpu_reason is None:
        from pdkv.gpu.guard import gpu_unavailable_reason  # noqa: PLC0415 - only for GPU KV

        index = int(device.split(":", 1)[1]) if ":" in device else 0
        gpu_reason = lambda: gpu_unavailable_reason(index)  # noqa: E731
    reason = gpu_reason()
    if reason is not None:
        raise ConfigError(f"{where}: CUDA is not available here: {reason}")
    # what the transport can do decides, not its name: the registration below is GPUDirect's
    # (the GPU allocation's dma-buf or peer memory handed to the NIC)
    if Capability.GPUDIRECT not in transports.capabilities(ms.transport, ms):
        if ms.staging == "off":
            raise ConfigError(f"{where}: messenger.staging off cannot work with messenger.transport "
                              f"{ms.transport} ({ms.transport} moves host memory only); use messenger.staging auto")
        return StagingMode.CUDA
    if gpudirect is None:
        from pdkv.gpu.gpudirect import gpudirect_possible, host_gpudirect_facts  # noqa: PLC0415

        gpudirect = lambda: gpudirect_possible(host_gpudirect_facts())  # noqa: E731
    can_register = (can_register_gpu or messenger_registers_gpu_memory)()
    possible, why = gpudirect()
    if ms.staging == "off":
        if not possible:
            raise ConfigError(f"{where}: messenger.transport {ms.transport} with messenger.staging off needs GPUDirect "
                              f"RDMA, and this host offers neither dma-buf nor peer memory ({why}); use "
                              "messenger.staging auto to stage the KV through pinned host memory")
        if not can_register:
            raise ConfigError(f"{where}: messenger.staging off needs the messenger to register GPU memory with "
                              "the NIC (ibv_reg_dmabuf_mr / nvidia-peermem), which this build does not; use "
                              "messenger.staging auto")
        return StagingMode.GPUDIRECT
    return StagingMode.GPUDIRECT if possible and can_register else StagingMode.CUDA


def prefill_ring_shape(cfg, page_nbytes: int, tp: int) -> tuple[int, int]:
    """(num_slots, slot_nbytes) of a prefill node's ring: a slot must hold one page of one layer
    from every rank (the smallest write a layer makes), else ConfigError."""
    ms = cfg.messenger
    slot = ms.staging_slot_kib * 1024
    need = tp * page_nbytes
    if slot < need:
        raise ConfigError(f"{cfg.source}: messenger.staging_slot_kib ({ms.staging_slot_kib} KiB) is too small for "
                          f"one layer's write: one page of one layer from each of the {tp} rank(s) is {need} bytes")
    return max(1, int(ms.staging_mib * MIB) // slot), slot


def decode_ring_shape(cfg, page_nbytes: int, num_layers: int, tp: int) -> tuple[int, int]:
    """(num_slots, slot_nbytes) of a decode node's ring: one landing slot per page, holding that
    page of every layer and rank (what the prefill node writes for it), else ConfigError."""
    ms = cfg.messenger
    slot = tp * num_layers * page_nbytes
    num = int(ms.staging_mib * MIB) // slot
    if num < 1:
        raise ConfigError(f"{cfg.source}: messenger.staging_mib ({ms.staging_mib:g} MiB) is too small for one "
                          f"page's writes: a page of all {num_layers} layers from each of the {tp} rank(s) "
                          f"is {slot} bytes")
    return num, slot


def make_ring(num_slots: int, slot_nbytes: int, mode: StagingMode):
    """The ring, pinned when a CUDA copy engine will use it."""
    from pdkv.gpu.staging import StagingRing  # noqa: PLC0415

    return StagingRing(num_slots, slot_nbytes, pin=mode is StagingMode.CUDA)


def region_buffers(regions) -> list:
    """Every rank's KV memory as a flat uint8 tensor (what the copy engine copies from/to)."""
    out = []
    for r in regions:
        flat = getattr(r.cache, "_buffer", None)  # NOTE: the KVCache's caller buffer (disagg nodes have one)
        if flat is None:
            raise ValueError(f"rank {r.rank}'s KV cache has no flat buffer to stage from "
                             "(build the engine with kv_buffer=pdkv.disagg.node.kv_buffer_factory(...))")
        out.append(flat)
    return out


def make_copy_engine(mode: StagingMode, ring, buffers, max_pending: int):
    """The copy engine of ``mode`` over every rank's KV buffer."""
    if mode is StagingMode.CUDA:
        from pdkv.gpu.cuda_copy_engine import CudaCopyEngine  # noqa: PLC0415 - GPU only

        return CudaCopyEngine(ring, buffers, max_pending)
    from pdkv.gpu.cpu_copy_engine import CpuCopyEngine  # noqa: PLC0415

    return CpuCopyEngine(ring, buffers, max_pending)
