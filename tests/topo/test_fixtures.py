"""Discovery and the messenger's NIC mapping on the committed host trees, asserted exactly."""

import os

import pytest

from pdkv.topo import TopologyError, bus_id_for_ordinal, discover, gpu_mapping, placement
from pdkv.topo.checks import warnings
from pdkv.topo.placement import nic_distance
from pdkv.topo.tree import format_cpulist

FIX = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures")
N0_DGX, N1_DGX = "0-55,112-167", "56-111,168-223"
N0_P5, N1_P5 = "0-47,96-143", "48-95,144-191"

DGX_EXPECTED = {
    "0000:1b:00.0": (["mlx5_0"], N0_DGX), "0000:20:00.0": (["mlx5_1"], N0_DGX),
    "0000:3d:00.0": (["mlx5_2"], N0_DGX), "0000:42:00.0": (["mlx5_3"], N0_DGX),
    "0000:9d:00.0": (["mlx5_6"], N1_DGX), "0000:a2:00.0": (["mlx5_7"], N1_DGX),
    "0000:bf:00.0": (["mlx5_8"], N1_DGX), "0000:c4:00.0": (["mlx5_9"], N1_DGX),
}
P5_EXPECTED = {
    "0000:4b:00.0": (["rdmap71s0", "rdmap72s0", "rdmap73s0", "rdmap74s0"], N0_P5),
    "0000:5c:00.0": (["rdmap88s0", "rdmap89s0", "rdmap90s0", "rdmap91s0"], N0_P5),
    "0000:6d:00.0": (["rdmap105s0", "rdmap106s0", "rdmap107s0", "rdmap108s0"], N0_P5),
    "0000:7e:00.0": (["rdmap122s0", "rdmap123s0", "rdmap124s0", "rdmap125s0"], N0_P5),
    "0000:ab:00.0": (["rdmap167s0", "rdmap168s0", "rdmap169s0", "rdmap170s0"], N1_P5),
    "0000:bc:00.0": (["rdmap184s0", "rdmap185s0", "rdmap186s0", "rdmap187s0"], N1_P5),
    "0000:cd:00.0": (["rdmap201s0", "rdmap202s0", "rdmap203s0", "rdmap204s0"], N1_P5),
    "0000:de:00.0": (["rdmap218s0", "rdmap219s0", "rdmap220s0", "rdmap221s0"], N1_P5),
}


@pytest.fixture(scope="module")
def dgx():
    return discover(os.path.join(FIX, "dgx-h100"))


@pytest.fixture(scope="module")
def p5():
    return discover(os.path.join(FIX, "aws-p5"))


@pytest.fixture(scope="module")
def bare():
    return discover(os.path.join(FIX, "no-accel"))


def _mapping(topology):
    return {g.bus_id: (p.nics, format_cpulist(p.cpus)) for g, p, err in gpu_mapping(topology)}


def test_dgx_inventory(dgx):
    assert [n.id for n in dgx.numa_nodes] == [0, 1]
    assert [len(n.cpus) for n in dgx.numa_nodes] == [112, 112]
    assert [g.bus_id for g in dgx.gpus] == sorted(DGX_EXPECTED)
    assert {g.model for g in dgx.gpus} == {"NVIDIA H100 80GB HBM3"}
    assert all(g.source == "nvidia-smi" and g.uuid.startswith("GPU-") for g in dgx.gpus)
    assert "0000:03:00.0" in dgx.pci and dgx.pci["0000:03:00.0"].class_code == "0x030000"  # BMC VGA
    assert [d.name for d in dgx.rdma] == [f"mlx5_{i}" for i in range(12)]
    ib = dgx.rdma_device("mlx5_0")
    assert ib.pci.bdf == "0000:1a:00.0" and ib.hca_type == "MT4129"
    port = ib.ports[0]
    assert (port.state, port.link_layer, port.rate, port.netdev) == \
        ("ACTIVE", "InfiniBand", "400 Gb/sec (4X NDR)", "ibp26s0")  # IPoIB found by PCI + dev_port
    assert port.gids[0].gid == "fe80:0000:0000:0000:a088:c203:001a:9e1a"
    roce = dgx.rdma_device("mlx5_4").ports[0]
    assert [(g.index, g.type) for g in roce.gids] == [(0, "IB/RoCE v1"), (1, "RoCE v2"),
                                                       (2, "IB/RoCE v1"), (3, "RoCE v2")]
    assert roce.gids[3].gid.endswith("ffff:0a00:000b") and roce.netdev == "enp91s0f0np0"
    assert (roce.netdev_mtu, roce.roce_mtu) == (9000, 4096)
    assert dgx.rdma_device("mlx5_5").ports[0].roce_mtu == 1024
    assert roce.suggested_gid_index == 3 and port.suggested_gid_index == 0
    assert dgx.rdma_device("mlx5_5").ports[0].suggested_gid_index is None  # no IP: no RoCE v2 GID
    assert dgx.rdma_device("mlx5_11").ports[0].state == "DOWN"
    nets = {n.name: n for n in dgx.net}
    assert nets["ibp26s0"].rdma == "mlx5_0" and nets["ibp26s0"].type == 32
    assert nets["eno1"].rdma == "" and nets["eno1"].speed_mbps == 10000
    assert nets["docker0"].pci is None and nets["eno2"].speed_mbps is None


def test_dgx_mapping_exact(dgx):
    assert _mapping(dgx) == DGX_EXPECTED
    for g, p, _ in gpu_mapping(dgx):
        assert p.reason.startswith(f"same PCIe switch as GPU {g.bus_id} (PIX)")
        assert "skipped" not in p.reason  # the down storage port is never near a GPU


def test_dgx_distances(dgx):
    gpu0 = dgx.gpu("0000:1b:00.0")
    tiers = {d.name: nic_distance(dgx, gpu0, d)[0] for d in dgx.rdma}
    assert tiers == {"mlx5_0": "PIX", "mlx5_1": "PXB", "mlx5_2": "NODE", "mlx5_3": "NODE",
                     "mlx5_4": "NODE", "mlx5_5": "NODE", "mlx5_6": "SYS", "mlx5_7": "SYS",
                     "mlx5_8": "SYS", "mlx5_9": "SYS", "mlx5_10": "SYS", "mlx5_11": "SYS"}


def test_dgx_warnings_name_the_field_mistakes(dgx):
    w = warnings(dgx)
    assert len(w) == 3, w
    assert "enp91s0f1np1 has MTU 1500" in w[0] and "path MTU 1024" in w[0]
    assert "mlx5_5 port 1: no routable RoCE v2 GID" in w[1]
    assert "mlx5_11 port 1 is DOWN" in w[2]


def test_p5_inventory_and_mapping_exact(p5):
    assert len(p5.rdma) == 32 and all(d.hca_type == "efa" for d in p5.rdma)
    assert all(g.source == "/proc/driver/nvidia" for g in p5.gpus) and len(p5.gpus) == 8
    assert _mapping(p5) == P5_EXPECTED
    used = [n for nics, _ in P5_EXPECTED.values() for n in nics]
    assert sorted(used) == sorted(d.name for d in p5.rdma)  # every EFA used exactly once
    assert warnings(p5) == []


def test_no_accelerator_host(bare):
    assert bare.gpus == () and bare.rdma == ()
    assert [(n.id, format_cpulist(n.cpus)) for n in bare.numa_nodes] == [(0, "0-15,32-47"),
                                                                         (1, "16-31,48-63")]
    assert [n.name for n in bare.net] == ["docker0", "eno1", "eno2", "lo", "veth1a2b3c"]
    assert [n.name for n in bare.net if n.pci is None] == ["docker0", "lo", "veth1a2b3c"]
    with pytest.raises(TopologyError, match="no RDMA device"):
        placement(bare, None, ["auto"])
    p = placement(bare, None, ["eno1"])
    assert (p.nics, format_cpulist(p.cpus)) == (["eno1"], "0-15,32-47")


def test_live_vm_capture(tmp_path):
    """A real capture of the CI VM: eth0 sits behind virtio2 on PCI 0000:00:03.0, numa_node -1."""
    vm = discover(os.path.join(FIX, "live-vm"))
    eth0 = next(n for n in vm.net if n.name == "eth0")
    assert eth0.pci.bdf == "0000:00:03.0" and eth0.pci.numa_node == -1
    assert vm.numa_of(eth0.pci) == 0  # a single-node host: -1 can only mean node 0
    assert vm.gpus == () and vm.rdma == ()


@pytest.mark.parametrize("host", ["dgx", "p5"])
def test_cuda_visible_devices_reordering_keeps_each_gpus_nics(host, request):
    topology = request.getfixturevalue(host)
    expected = DGX_EXPECTED if host == "dgx" else P5_EXPECTED
    uuids = [g.uuid for g in topology.gpus]
    envs = [{}, {"CUDA_VISIBLE_DEVICES": "0,1,2,3,4,5,6,7"},
            {"CUDA_VISIBLE_DEVICES": "7,6,5,4,3,2,1,0"}, {"CUDA_VISIBLE_DEVICES": "3,0,6"},
            {"CUDA_VISIBLE_DEVICES": ",".join(u[:12] for u in reversed(uuids)),
             "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}]
    first_gpu_nics = []
    for env in envs:
        n = len(env["CUDA_VISIBLE_DEVICES"].split(",")) if env else 8
        for ordinal in range(n):
            bus = bus_id_for_ordinal(topology, ordinal, env)
            p = placement(topology, bus, ["auto"])
            assert (p.nics, format_cpulist(p.cpus)) == expected[bus], (env, ordinal)
            if ordinal == 0:
                first_gpu_nics.append(p.nics)
    # cuda:0 is a different GPU in these environments, so it gets different NICs: the
    # assignment follows the GPU, not the ordinal.
    assert first_gpu_nics[2] == expected[topology.gpus[7].bus_id][0] != first_gpu_nics[1]
    assert first_gpu_nics[3] == expected[topology.gpus[3].bus_id][0]
    assert first_gpu_nics[4] == first_gpu_nics[2]
