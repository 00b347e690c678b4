"""The messenger takes its NIC and poller CPUs from the topology when told `nics: [auto]`.

The verbs cases open a real verbs transport over the loopback verbs device in a child process
whose device list holds only the NIC the topology should choose: picking any other NIC fails.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from pdkv.config import MessengerConfig
from pdkv.messenger import plan_placement
from pdkv.topo import TopologyError

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = ROOT / "tests" / "topo" / "fixtures"
DGX = str(FIXTURES / "dgx-h100")


def test_auto_follows_the_gpu_and_pins_to_cpus_that_exist_here():
    p = plan_placement(MessengerConfig(transport="verbs", nics=("auto",)), "0000:3d:00.0", DGX)
    assert p.nics == ("mlx5_2",)
    # the fixture's NUMA node 0 has CPUs 0-55; only those this process may run on are kept
    assert set(p.cpus) == set(range(56)) & os.sched_getaffinity(0)
    assert "same PCIe switch" in p.reason


def test_auto_with_several_nearby_nics_uses_them_all():
    p = plan_placement(MessengerConfig(transport="verbs", nics=("auto",)), "0000:4b:00.0",
                       str(FIXTURES / "aws-p5"))
    assert p.nics[:2] == ("rdmap71s0", "rdmap72s0") and len(p.nics) > 2
    assert p.rank_nics == (tuple(range(len(p.nics))),)  # one rank, every NIC of its PCIe switch


def test_explicit_list_wins_over_topology():
    p = plan_placement(MessengerConfig(transport="verbs", nics=("mlx5_5",)), "0000:3d:00.0", DGX)
    assert p.nics == ("mlx5_5",)


def test_auto_without_rdma_is_a_clear_error():
    with pytest.raises(TopologyError, match="no RDMA device"):
        plan_placement(MessengerConfig(transport="verbs", nics=("auto",)), None,
                       str(FIXTURES / "no-accel"))


def test_tcp_ignores_nics():
    p = plan_placement(MessengerConfig(transport="tcp", nics=("auto",)), None,
                       str(FIXTURES / "no-accel"))
    assert p.nics == () and p.cpus == ()


CHILD = """
import sys
from pdkv.config import MessengerConfig
from pdkv.messenger import open_messenger
nics = tuple(sys.argv[1].split(","))
m = open_messenger(MessengerConfig(transport="verbs", nics=nics), 7, gpu_bus_id="0000:3d:00.0",
                   sysfs_root=sys.argv[2])
key = m.register(bytearray(4096))
print("opened", key > 0)
m.close()
"""


def run_child(loopback_dir, device_list, nics):
    env = dict(os.environ, LD_LIBRARY_PATH=loopback_dir, PDKV_LOOPBACK_NICS=device_list)
    return subprocess.run([sys.executable, "-c", CHILD, nics, DGX], env=env, cwd=str(ROOT),
                          capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("device_list,nics,ok", [
    ("mlx5_2", "auto", True),            # topology picks mlx5_2: the only device there is
    ("mlx5_0,mlx5_1", "auto", False),    # ... so a host without it cannot satisfy auto
    ("mlx5_7", "mlx5_7", True),          # explicit wins, whatever the GPU
    ("mlx5_2", "mlx5_9", False),         # a NIC that does not exist is named
])
def test_verbs_transport_opens_the_chosen_nic(loopback_verbs_dir, device_list, nics, ok):
    r = run_child(loopback_verbs_dir, device_list, nics)
    if ok:
        assert r.returncode == 0 and "opened True" in r.stdout, r.stderr
    else:
        assert r.returncode != 0
        wanted = "mlx5_2" if nics == "auto" else nics
        assert wanted in r.stderr and "not found" in r.stderr, r.stderr


@pytest.mark.parametrize("tp", [1, 8])
def test_libfabric_auto_gives_each_rank_the_efa_devices_nearest_its_gpu(tp):
    """AWS p5 (tests/topo/fixtures/aws-p5: 8 H100, 4 EFA devices under each GPU's PCIe switch):
    libfabric's domains [auto] is the verbs placement of the same devices (named
    ``<device>-rdm``, libfabric's RDM domain), each rank's four nearest its own GPU."""
    from pdkv.config import LibfabricConfig
    from pdkv.topo import discover

    p5 = str(FIXTURES / "aws-p5")
    t = discover(p5)
    gpus = [g.bus_id for g in t.gpus][:tp]
    efa = LibfabricConfig(provider="efa", domains=("auto",))
    p = plan_placement(MessengerConfig(transport="libfabric", libfabric=efa), sysfs_root=p5, gpu_bus_ids=gpus)
    v = plan_placement(MessengerConfig(transport="verbs", nics=("auto",)), sysfs_root=p5, gpu_bus_ids=gpus)
    per_rank = 4 if tp == 1 else 2  # TP8: 32 devices, one transport drives 16 (the two nearest per GPU)
    assert [[p.nics[i] for i in r] for r in p.rank_nics] == \
        [[f"{v.nics[i]}-rdm" for i in r[:per_rank]] for r in v.rank_nics] and p.cpus == v.cpus
    assert len(p.nics) == per_rank * tp and all(len(r) == per_rank for r in p.rank_nics)
    assert tp == 1 or "16 domains at most per transport: each rank's 2 nearest" in p.reason
    for r, gpu in enumerate(t.gpus[:tp]):
        for i in p.rank_nics[r]:
            nic = next(n for n in t.rdma if n.name == p.nics[i].removesuffix("-rdm"))
            assert nic.hca_type == "efa" and nic.pci.path[:3] == gpu.pci.path[:3], (r, nic)
    assert "same PCIe switch" in p.reason, p.reason


def test_libfabric_named_domains_are_dealt_to_the_ranks():
    from pdkv.config import LibfabricConfig

    named = LibfabricConfig(provider="tcp;ofi_rxm", domains=("lo",))
    assert plan_placement(MessengerConfig(transport="libfabric", libfabric=named)).nics == ("lo",)
    two = MessengerConfig(transport="libfabric", libfabric=LibfabricConfig(provider="tcp;ofi_rxm",
                                                                           domains=("lo@127.0.0.1/32", "lo@::1/128")))
    assert plan_placement(two, num_ranks=2).rank_nics == ((0,), (1,))
    assert plan_placement(two).rank_nics == ((0, 1),)  # one rank: both, a request's seed picks
    first = plan_placement(MessengerConfig(transport="libfabric"))
    assert first.nics == () and first.rank_nics == ()  # the provider's first domain: one path
    with pytest.raises(TopologyError, match="needs provider efa"):
        plan_placement(MessengerConfig(transport="libfabric",
                                       libfabric=LibfabricConfig(provider="shm", domains=("auto",))))
