"""The small pure pieces: CPU lists, bus ids, RoCE MTU, CUDA_VISIBLE_DEVICES rules, link manifest."""

import os

import pytest

from pdkv.topo import RdmaPort, TopologyError, bus_id_for_ordinal, cuda_mapping, discover
from pdkv.topo.gpu import parse_smi_csv, run_nvidia_smi
from pdkv.topo.pcie import normalize_bus_id
from pdkv.topo.tree import (format_cpulist, format_link_manifest, is_back_link, parse_cpulist,
                            parse_link_manifest)

FIX = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures")


def test_cpulists():
    assert parse_cpulist("0-3,8,10-11\n") == (0, 1, 2, 3, 8, 10, 11)
    assert parse_cpulist("") == () and parse_cpulist(None) == ()
    assert format_cpulist([11, 0, 1, 2, 3, 8, 10]) == "0-3,8,10-11"
    assert format_cpulist(parse_cpulist("0-55,112-167")) == "0-55,112-167"
    with pytest.raises(ValueError, match="bad CPU list 'zero'"):
        parse_cpulist("zero")


@pytest.mark.parametrize("text, want", [
    ("0000:1b:00.0", "0000:1b:00.0"), ("00000000:1B:00.0", "0000:1b:00.0"),
    ("1b:00.0", "0000:1b:00.0"), (" 0001:C4:1F.7 ", "0001:c4:1f.7")])
def test_bus_id_spellings(text, want):
    assert normalize_bus_id(text) == want


@pytest.mark.parametrize("bad", ["cuda:0", "1b:00", "0000:1b:00.8", ""])
def test_bad_bus_ids_are_named(bad):
    with pytest.raises(TopologyError, match="is not a PCI bus id"):
        normalize_bus_id(bad)


@pytest.mark.parametrize("mtu, want", [(1500, 1024), (2200, 2048), (4191, 2048), (4192, 4096), (9000, 4096),
                                       (300, None)])
def test_roce_path_mtu_follows_the_kernel(mtu, want):
    port = RdmaPort(1, "ACTIVE", "LinkUp", "Ethernet", "", netdev="x", netdev_mtu=mtu)
    assert port.roce_mtu == want
    assert RdmaPort(1, "ACTIVE", "LinkUp", "InfiniBand", "", netdev_mtu=mtu).roce_mtu is None


def test_cuda_visible_devices_rules():
    p5 = discover(os.path.join(FIX, "aws-p5"))
    bus = [g.bus_id for g in p5.gpus]
    assert cuda_mapping(p5, {}).bus_ids == tuple(bus)
    assert cuda_mapping(p5, {"CUDA_VISIBLE_DEVICES": ""}).bus_ids == ()
    m = cuda_mapping(p5, {"CUDA_VISIBLE_DEVICES": "2,9,1"})  # CUDA stops at the bad entry
    assert m.bus_ids == (bus[2],) and "'9' is not a GPU index (this host has 8)" in m.notes[0]
    assert cuda_mapping(p5, {"CUDA_VISIBLE_DEVICES": "1,1"}).bus_ids == (bus[1],)
    uuid5 = p5.gpus[5].uuid
    assert cuda_mapping(p5, {"CUDA_VISIBLE_DEVICES": f"{uuid5[:10]},0"}).bus_ids == (bus[5], bus[0])
    m = cuda_mapping(p5, {"CUDA_VISIBLE_DEVICES": "GPU-05"})  # a prefix of all eight UUIDs
    assert m.bus_ids == () and "matches 8 GPU UUIDs" in m.notes[0]
    assert "MIG instance" in cuda_mapping(p5, {"CUDA_VISIBLE_DEVICES": "MIG-abc"}).notes[0]
    with pytest.raises(TopologyError, match=r"cuda:2 does not exist: CUDA_VISIBLE_DEVICES='4,5' makes 2"):
        bus_id_for_ordinal(p5, 2, {"CUDA_VISIBLE_DEVICES": "4,5"})


def test_back_links_are_kept_in_the_manifest():
    assert is_back_link("sys/devices/pci0000:00/0000:00:03.0/net/eth0/device", "../../../0000:00:03.0")
    assert not is_back_link("sys/class/net/eth0", "../../devices/pci0000:00/0000:00:03.0/net/eth0")
    assert not is_back_link("sys/devices/x/driver", "../../bus/pci/drivers/nvidia")
    links = {"b/c/device": "../..", "a/d/device": "../../x"}
    assert parse_link_manifest(format_link_manifest(links)) == links


def test_nvidia_smi_is_run_and_its_failures_are_reported(tmp_path, monkeypatch):
    # A stand-in nvidia-smi (this machine has no NVIDIA driver): a script answering the query.
    fake = tmp_path / "nvidia-smi"
    fake.write_text("#!/bin/sh\necho '0, 00000000:1B:00.0, GPU-abc, NVIDIA H100 80GB HBM3'\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    text, why = run_nvidia_smi()
    assert parse_smi_csv(text) == {"0000:1b:00.0": ("NVIDIA H100 80GB HBM3", "GPU-abc")} and why == ""
    fake.write_text("#!/bin/sh\necho 'NVIDIA-SMI has failed because it could not communicate' >&2\nexit 9\n")
    assert run_nvidia_smi() == (None, "nvidia-smi exited 9: NVIDIA-SMI has failed because it could "
                                      "not communicate")


def test_gpu_without_driver_is_still_a_gpu_and_noted(tmp_path):
    import sys
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    try:
        from topo_sysfs_writer import HostWriter
    finally:
        sys.path.pop(0)
    w = HostWriter()
    w.numa(0, "0-3", 1000)
    w.pci("pci0000:00", "0000:00:02.0", "0x030200", "0x10de", "0x2330", 0, "0-3", None)
    w.save(str(tmp_path / "t"))
    topo = discover(str(tmp_path / "t"))
    assert [(g.bus_id, g.source, g.model) for g in topo.gpus] == [("0000:00:02.0", "pci", "")]
    assert any("no driver information" in n for n in topo.notes)
