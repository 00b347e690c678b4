"""Config validation and the staging choice read what a transport can do (pdkv/transports.py),
not its name: a transport registered here for the test (as a plugin would be) gets the checks
its capabilities call for, with no other change."""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import importlib

import pytest

from pdkv import transports
from pdkv.config import ConfigError, config_from_dict
from pdkv.disagg.staged import StagingMode, staging_mode
from pdkv.transports import Capability


@pytest.fixture
def plugin(monkeypatch):
    """Register a transport named "plugin" with the given capabilities for one test."""

    def make(caps: Capability):
        @dataclass(frozen=True)
        class PluginOptions:
            in_config: ClassVar[bool] = True
            probe_rdma: ClassVar[bool] = False

        monkeypatch.setitem(transports.OPTIONS, "plugin", PluginOptions)
        PluginOptions.name, PluginOptions.capabilities = "plugin", caps
        validate = importlib.import_module("pdkv.config.validate")  # the module, not the function
        monkeypatch.setattr(validate, "TRANSPORTS", (*validate.TRANSPORTS, "plugin"))
        return PluginOptions

    return make


def _cfg(role="decode", device="cpu", **ms):
    if role == "decode":
        ms.setdefault("prefill_peers", ["127.0.0.1:9"])
    return config_from_dict({"role": role, "model": {"device": device}, "messenger": ms})


def test_the_shipped_transports_declare_what_they_can_do():
    assert Capability.GPUDIRECT in transports.capabilities("verbs")
    assert Capability.DEVICE_MEMORY not in transports.capabilities("tcp")
    assert Capability.SEALED_STREAMS in transports.capabilities("tcp")
    assert all(Capability.HOST_MEMORY in c.capabilities for c in transports.OPTIONS.values())
    assert "fake" not in transports.config_names() and "verbs" in transports.config_names()
    with pytest.raises(ValueError, match="unknown transport 'udp'"):
        transports.capabilities("udp")


def test_a_same_host_only_transport_takes_loopback_peers_only(plugin):
    plugin(Capability.HOST_MEMORY | Capability.SAME_HOST_ONLY)
    for peer in ("127.0.0.1:9", "localhost:9", "[::1]:9"):
        assert _cfg(transport="plugin", prefill_peers=[peer]).messenger.transport == "plugin"
    with pytest.raises(ConfigError, match=r"messenger.prefill_peers.*addresses of this host.*one host only"):
        _cfg(transport="plugin", prefill_peers=["10.1.2.3:9"])
    _cfg(transport="tcp", prefill_peers=["10.1.2.3:9"])  # tcp: any host


def test_sealed_streams_and_staging_off_follow_the_capabilities(plugin):
    plugin(Capability.HOST_MEMORY | Capability.PEER_ISOLATION)
    with pytest.raises(ConfigError, match=r"tls_data.*false with transport plugin.*that can: tcp"):
        _cfg(transport="plugin", tls_data=True)
    with pytest.raises(ConfigError, match="messenger.staging.*auto with model.device cuda"):
        _cfg("prefill", "cuda", transport="plugin", staging="off")
    # host memory only: GPU KV is staged
    assert staging_mode(_cfg("prefill", "cuda", transport="plugin"), gpu_reason=lambda: None) is StagingMode.CUDA


def test_a_gpudirect_transport_takes_the_gpudirect_path(plugin):
    plugin(Capability.HOST_MEMORY | Capability.DEVICE_MEMORY | Capability.GPUDIRECT)
    cfg = _cfg("prefill", "cuda", transport="plugin", staging="off")  # validation lets it through
    assert staging_mode(cfg, gpu_reason=lambda: None, gpudirect=lambda: (True, ""),
                        can_register_gpu=lambda: True) is StagingMode.GPUDIRECT
    with pytest.raises(ConfigError, match="messenger.transport plugin with messenger.staging off needs GPUDirect"):
        staging_mode(cfg, gpu_reason=lambda: None, gpudirect=lambda: (False, "no dma-buf"),
                     can_register_gpu=lambda: True)


def _fabric(role="decode", device="cpu", provider="tcp;ofi_rxm", **ms):
    return _cfg(role, device, transport="libfabric", libfabric={"provider": provider}, **ms)


def test_libfabric_capabilities_are_its_providers():
    """One transport, several providers: what each can do is the C row (every provider) plus
    what that provider adds; validation and staging read the provider's, not the row's."""
    row = transports.capabilities("libfabric")
    assert Capability.GPUDIRECT not in row and Capability.SAME_HOST_ONLY not in row
    caps = {p: transports.capabilities("libfabric", _fabric(provider=p).messenger)
            for p in ("efa", "shm", "tcp;ofi_rxm", "sockets", "auto")}
    assert Capability.GPUDIRECT in caps["efa"] and Capability.DEVICE_MEMORY in caps["efa"]
    assert Capability.SAME_HOST_ONLY in caps["shm"] and Capability.GPUDIRECT not in caps["shm"]
    assert caps["tcp;ofi_rxm"] == caps["sockets"] == caps["auto"] == row
    # the options the node makes ask the provider for device memory exactly where it is declared
    opts = {p: transports.LibfabricOptions.from_config(_fabric(provider=p).messenger,
                                                       type("W", (), {"nics": ()})())
            for p in ("efa", "shm", "tcp;ofi_rxm")}
    assert opts["efa"].device_memory and not opts["shm"].device_memory
    assert not opts["tcp;ofi_rxm"].device_memory


def test_libfabric_shm_takes_this_hosts_peers_only_and_efa_goes_gpudirect():
    with pytest.raises(ConfigError, match=r"prefill_peers.*libfabric, which connects processes of one host"):
        _fabric(provider="shm", prefill_peers=["10.1.2.3:9"])
    assert _fabric(provider="tcp;ofi_rxm", prefill_peers=["10.1.2.3:9"]).messenger.transport == "libfabric"
    # GPU KV: efa registers it with the device; a software provider stages it through host memory
    with pytest.raises(ConfigError, match="messenger.staging.*auto with model.device cuda"):
        _fabric("prefill", "cuda", provider="sockets", staging="off")
    efa = _fabric("prefill", "cuda", provider="efa", staging="off")
    assert staging_mode(efa, gpu_reason=lambda: None, gpudirect=lambda: (True, ""),
                        can_register_gpu=lambda: True) is StagingMode.GPUDIRECT
    sockets = _fabric("prefill", "cuda", provider="sockets")
    assert staging_mode(sockets, gpu_reason=lambda: None, gpudirect=lambda: (True, ""),
                        can_register_gpu=lambda: True) is StagingMode.CUDA
