"""placement(): explicit lists, errors, and the fallbacks, on copies of the DGX tree with faults
injected (a NIC removed, a port down, numa_node missing) the way they show up in the field."""

import dataclasses
import os
import shutil

import pytest

from pdkv.topo import Placement, TopologyError, discover, placement
from pdkv.topo.checks import warnings
from pdkv.topo.tree import format_cpulist

FIX = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures")
GPU0, GPU4 = "0000:1b:00.0", "0000:9d:00.0"
GPU6, GPU7 = "0000:bf:00.0", "0000:c4:00.0"


@pytest.fixture(scope="module")
def dgx():
    return discover(os.path.join(FIX, "dgx-h100"))


def faulty_dgx(parent, remove=(), down=(), files=None):
    """A copy of the DGX tree with RDMA devices unplugged, ports down, or attributes rewritten.

    Files are hard links into the committed fixture (cheap), so every change below unlinks a
    file before writing its replacement: the fixture itself is never written.
    """
    root = os.path.join(parent, "dgx")
    shutil.copytree(os.path.join(FIX, "dgx-h100"), root, symlinks=True, copy_function=os.link)

    def rewrite(path, text):
        os.unlink(path)
        with open(path, "w") as f:
            f.write(text + "\n")

    for name in remove:  # as if the driver had not bound: the class entry is gone
        os.unlink(os.path.join(root, "sys/class/infiniband", name))
    for name in down:
        port = os.path.realpath(os.path.join(root, "sys/class/infiniband", name, "ports/1"))
        rewrite(os.path.join(port, "state"), "1: DOWN")
        rewrite(os.path.join(port, "phys_state"), "3: Disabled")
    for rel, text in (files or {}).items():
        rewrite(os.path.realpath(os.path.join(root, rel)), text)
    return root


@pytest.fixture(scope="module")
def faulty(tmp_path_factory):
    """One copy of the DGX tree with faults, as they show up in the field:
    every NUMA-0 NIC unplugged (mlx5_0-5) and GPU6/GPU7's NICs too (mlx5_8, mlx5_9); mlx5_6 (GPU4's)
    down; GPU6's PCIe link trained at x8; GPU7's numa_node reads -1; mlx5_7's class link is
    absolute (a tree copied with cp -a from /sys). Left active: mlx5_7 and mlx5_10 (NUMA 1)."""
    root = faulty_dgx(tmp_path_factory.mktemp("faulty"),
                      remove=["mlx5_0", "mlx5_1", "mlx5_2", "mlx5_3", "mlx5_4", "mlx5_5", "mlx5_8",
                              "mlx5_9"], down=["mlx5_6"],
                      files={f"sys/bus/pci/devices/{GPU6}/current_link_width": "8",
                             f"sys/bus/pci/devices/{GPU7}/numa_node": "-1",
                             f"sys/bus/pci/devices/{GPU7}/local_cpulist": "56-63"})
    link = os.path.join(root, "sys/class/infiniband/mlx5_7")
    target = os.path.normpath(os.path.join("/sys/class/infiniband", os.readlink(link)))
    os.unlink(link)
    os.symlink(target, link)  # "/sys/devices/pci0000:97/...": not on this machine
    return discover(root)


def test_a_down_port_is_skipped_and_named(faulty):
    p = placement(faulty, GPU4)
    assert p.nics == ["mlx5_7"]  # next under the same switch complex
    assert "(PXB)" in p.reason and "skipped mlx5_6 (no ACTIVE port)" in p.reason
    assert faulty.rdma_device("mlx5_7").pci.bdf == "0000:a1:00.0"  # absolute link read in-tree


def test_numa_fallback_when_the_switch_has_no_nic(faulty):
    p = placement(faulty, GPU6)
    assert p.nics == ["mlx5_7", "mlx5_10"]
    assert format_cpulist(p.cpus) == "56-111,168-223"
    assert "falling back to its NUMA node 1 (NODE)" in p.reason
    assert "skipped mlx5_6, mlx5_11 (no ACTIVE port)" in p.reason  # as near, but down
    w = warnings(faulty)
    assert any(x.startswith(f"GPU {GPU6} has no RDMA NIC under its PCIe switch (nearest: NODE)")
               for x in w)


def test_other_node_fallback_says_so(faulty):
    p = placement(faulty, GPU0)
    assert p.nics == ["mlx5_7", "mlx5_10"]
    assert format_cpulist(p.cpus) == "0-55,112-167"  # the poller stays near the GPU
    assert "other nodes (SYS" in p.reason


def test_unknown_numa_node_uses_local_cpus_and_warns(faulty):
    p = placement(faulty, GPU7)
    assert p.nics == ["mlx5_7", "mlx5_10"] and p.cpus == list(range(56, 64))
    assert any("numa_node = -1" in w and GPU7 in w for w in warnings(faulty))


def test_degraded_pcie_link_warns(faulty):
    assert any(w.startswith(f"{GPU6}: PCIe link at 32.0 GT/s PCIe x8") for w in warnings(faulty))


def test_all_ports_down_is_an_error(dgx):
    only_down = dataclasses.replace(dgx, rdma=tuple(d for d in dgx.rdma if d.name == "mlx5_11"))
    with pytest.raises(TopologyError, match=r"no ACTIVE port \(mlx5_11 port 1 DOWN\)"):
        placement(only_down, GPU0)
    with pytest.raises(TopologyError, match="no RDMA device"):
        placement(dataclasses.replace(dgx, rdma=()), GPU0)


def test_placement_is_the_documented_frozen_shape(dgx):
    p = placement(dgx, GPU0, ["auto"])
    assert [f.name for f in dataclasses.fields(Placement)] == ["nics", "cpus", "reason"]
    assert isinstance(p.nics, list) and isinstance(p.cpus, list)
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.nics = []


def test_bus_id_spellings_name_the_same_gpu(dgx):
    for spelling in ("0000:1b:00.0", "00000000:1B:00.0", "1b:00.0"):
        assert placement(dgx, spelling).nics == ["mlx5_0"]
    with pytest.raises(TopologyError, match=r"no GPU at PCI bus id '0000:1c:00.0'.*0000:1b:00.0, 0000:2"):
        placement(dgx, "0000:1c:00.0")
    with pytest.raises(TopologyError, match="not a PCI bus id"):
        placement(dgx, "cuda:0")


def test_explicit_list_wins_even_when_far(dgx):
    p = placement(dgx, GPU0, ["mlx5_6", "mlx5_7:1"])
    assert p.nics == ["mlx5_6", "mlx5_7:1"]
    assert format_cpulist(p.cpus) == "56-111,168-223"  # the NICs' node: the poller drives them
    assert "explicit NIC list" in p.reason and "mlx5_6 SYS" in p.reason
    assert placement(dgx, None, ["ibp26s0"]).nics == ["ibp26s0"]  # an interface name is a NIC too
    assert placement(dgx, GPU0, "mlx5_0").nics == ["mlx5_0"]  # a single name, not a list


def test_missing_nic_is_a_clear_error(dgx):
    with pytest.raises(TopologyError) as e:
        placement(dgx, GPU0, ["mlx5_0", "mlx5_99", "eth7"])
    msg = str(e.value)
    assert "'mlx5_99' and 'eth7' does not exist" in msg
    assert "RDMA devices: mlx5_0, mlx5_1, mlx5_2" in msg and "ibp26s0" in msg
    with pytest.raises(TopologyError, match=r"'mlx5_0:2' \(device mlx5_0 has ports 1\)"):
        placement(dgx, GPU0, ["mlx5_0:2"])
    with pytest.raises(TopologyError, match="cannot be mixed"):
        placement(dgx, GPU0, ["auto", "mlx5_0"])
    with pytest.raises(TopologyError, match="nics is empty"):
        placement(dgx, GPU0, [])


def test_no_gpu_auto_uses_every_active_nic_on_any_node(dgx):
    p = placement(dgx, None, ["auto"])
    assert p.nics == [f"mlx5_{i}" for i in range(11)]  # mlx5_11 is down
    assert format_cpulist(p.cpus) == "0-223"
    assert "no GPU given" in p.reason and "any NUMA node" in p.reason
    assert "skipped mlx5_11 (no ACTIVE port)" in p.reason
