"""Which way a node's KV travels (pdkv/disagg/staged.py), and the combinations refused with an
error that names them. The host probes are parameters, so hosts this one is not are played
here; the real probes run too (this machine has no GPU: cuda is refused naming why)."""
from __future__ import annotations

import pytest

from pdkv.config import ConfigError, config_from_dict
from pdkv.disagg.staged import StagingMode, decode_ring_shape, prefill_ring_shape, staging_mode
from pdkv.gpu import gpu_unavailable_reason


def _cfg(role="prefill", device="cpu", **ms):
    d = {"role": role, "model": {"device": device}, "messenger": ms}
    if role == "decode":
        ms.setdefault("prefill_peers", ["127.0.0.1:9"])
    return config_from_dict(d)


GPU_OK = dict(gpu_reason=lambda: None)
NO_GPUDIRECT = (False, "dma-buf needs NVIDIA's open kernel module, this host runs the proprietary one; "
                       "nvidia-peermem is not loaded")


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_modes_on_hosts_that_can(role):
    assert staging_mode(_cfg(role)) is StagingMode.OFF  # host KV goes direct
    assert staging_mode(_cfg(role, staging="cpu")) is StagingMode.CPU
    assert staging_mode(_cfg(role, "cuda"), **GPU_OK) is StagingMode.CUDA  # tcp: always staged
    verbs = _cfg(role, "cuda:1", transport="verbs")
    assert staging_mode(verbs, **GPU_OK, gpudirect=lambda: (True, ""), can_register_gpu=lambda: True) \
        is StagingMode.GPUDIRECT
    # auto falls back to staging where GPUDirect is missing on the host or in the messenger
    assert staging_mode(verbs, **GPU_OK, gpudirect=lambda: NO_GPUDIRECT, can_register_gpu=lambda: True) \
        is StagingMode.CUDA
    assert staging_mode(verbs, **GPU_OK, gpudirect=lambda: (True, ""), can_register_gpu=lambda: False) \
        is StagingMode.CUDA
    # libfabric with provider auto (any provider: promised host memory only): GPU KV is staged, off is
    # refused (provider efa declares GPUDirect: tests/config/test_transport_capabilities.py)
    fabric = _cfg(role, "cuda", transport="libfabric")
    assert staging_mode(fabric, **GPU_OK, gpudirect=lambda: (True, ""), can_register_gpu=lambda: True) \
        is StagingMode.CUDA
    with pytest.raises(ConfigError, match="must be auto with model.device cuda and messenger.transport libfabric"):
        staging_mode(_cfg(role, "cuda", transport="libfabric", staging="off"), **GPU_OK)


@pytest.mark.skipif(gpu_unavailable_reason() is None, reason="this host has a GPU")
def test_cuda_without_cuda_is_refused_naming_what_is_missing():
    with pytest.raises(ConfigError) as e:
        staging_mode(_cfg("decode", "cuda"))  # the real probe
    msg = str(e.value)
    assert "role decode with model.device cuda" in msg and "CUDA is not available here" in msg, msg
    assert gpu_unavailable_reason() in msg


def test_verbs_on_gpu_memory_without_dmabuf_or_peermem_is_refused_naming_both():
    with pytest.raises(ConfigError) as e:
        staging_mode(_cfg("prefill", "cuda", transport="verbs", staging="off"), **GPU_OK,
                     gpudirect=lambda: NO_GPUDIRECT, can_register_gpu=lambda: True)
    msg = str(e.value)
    assert "verbs with messenger.staging off needs GPUDirect RDMA" in msg and "neither dma-buf nor peer memory" in msg
    assert "proprietary" in msg and "nvidia-peermem" in msg and "messenger.staging auto" in msg
    with pytest.raises(ConfigError, match="register GPU memory with the NIC"):
        staging_mode(_cfg("prefill", "cuda", transport="verbs", staging="off"), **GPU_OK,
                     gpudirect=lambda: (True, ""), can_register_gpu=lambda: False)


def test_config_refuses_what_cannot_work_and_accepts_cuda_for_the_roles():
    assert _cfg("prefill", "cuda").model.device == "cuda"  # no longer refused for the roles
    assert _cfg("decode", "cuda:3", transport="verbs", staging="off").messenger.staging == "off"
    with pytest.raises(ConfigError, match="messenger.staging must be auto with model.device cuda and "
                                          "messenger.transport tcp"):
        _cfg("prefill", "cuda", staging="off")
    with pytest.raises(ConfigError, match="messenger.staging must be auto or off with model.device cuda"):
        _cfg("decode", "cuda", staging="cpu")
    with pytest.raises(ConfigError, match="messenger.staging must be one of auto, off, cpu, got 'gpu'"):
        _cfg("prefill", staging="gpu")
    with pytest.raises(ConfigError, match="messenger.staging_slot_kib must be at most messenger.staging_mib"):
        _cfg("prefill", staging_mib=1.0, staging_slot_kib=2048)


def test_rings_too_small_for_one_layers_write_are_refused():
    cfg = _cfg("prefill", staging="cpu", staging_slot_kib=4, staging_mib=1.0)
    assert prefill_ring_shape(cfg, page_nbytes=1024, tp=4) == (256, 4096)
    with pytest.raises(ConfigError, match=r"staging_slot_kib \(4 KiB\) is too small for one layer's write: "
                                          r"one page of one layer from each of the 8 rank\(s\) is 8192 bytes"):
        prefill_ring_shape(cfg, page_nbytes=1024, tp=8)
    dcfg = _cfg("decode", staging="cpu", staging_mib=1 / 64)  # 16 KiB
    assert decode_ring_shape(dcfg, page_nbytes=1024, num_layers=2, tp=2) == (4, 4096)
    with pytest.raises(ConfigError, match=r"staging_mib \(0.015625 MiB\) is too small for one page's writes: "
                                          r"a page of all 32 layers"):
        decode_ring_shape(dcfg, page_nbytes=1024, num_layers=32, tp=1)
