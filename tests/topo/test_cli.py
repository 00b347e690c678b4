"""tools/topo as users run it: on this machine (what it reports is checked against this host's
sysfs, whatever it has), on captures, with bad input."""

import json
import os
import subprocess
import sys

import pytest

from pdkv.topo.cli import main

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOOL = os.path.join(REPO, "tools", "topo")
FIX = os.path.join(REPO, "tests", "topo", "fixtures")


def run(*args, cwd=REPO, flags=()):
    return subprocess.run([sys.executable, *flags, TOOL, *args], cwd=cwd, capture_output=True,
                          text=True, timeout=120)


def host_gpus() -> list[str]:
    """NVIDIA display-class PCI devices of this host, read from sysfs here (not by pdkv.topo)."""
    found = []
    root = "/sys/bus/pci/devices"
    for bdf in sorted(os.listdir(root)) if os.path.isdir(root) else []:
        try:
            with open(f"{root}/{bdf}/vendor") as v, open(f"{root}/{bdf}/class") as c:
                if v.read().strip() == "0x10de" and c.read().strip().startswith("0x03"):
                    found.append(bdf)
        except OSError:
            continue
    return found


def host_rdma() -> list[str]:
    root = "/sys/class/infiniband"
    return sorted(os.listdir(root)) if os.path.isdir(root) else []


def test_live_report_matches_this_host(tmp_path):
    # -S: no site-packages, so pdkv is not importable and the tool must find the checkout itself.
    res = run(cwd=str(tmp_path), flags=("-S",))
    assert res.returncode == 0, res.stderr
    out = res.stdout
    gpus, rdma = host_gpus(), host_rdma()
    assert ("No GPU found" in out) == (not gpus)
    assert all(bdf in out for bdf in gpus)
    assert ("No RDMA device found" in out) == (not rdma)
    assert all(f"\n  {name} " in out for name in rdma)
    assert "NUMA nodes (" in out and "node  cpus" in out
    for name in os.listdir("/sys/class/net"):
        assert f"\n  {name} " in out
    # the messenger's verbs answer: an error exactly where auto has nothing to choose from
    assert ("error: nics: auto found no RDMA device" in out) == (not rdma)


@pytest.mark.parametrize("fixture, gpus, rdma", [("no-accel", False, False), ("live-vm", False, False),
                                                 ("dgx-h100", True, True), ("aws-p5", True, True)])
def test_report_says_what_is_missing_on_captures(fixture, gpus, rdma, capsys):
    """What the live report says on a host without a GPU or RDMA, shown on captured hosts."""
    assert main(["--sysfs", os.path.join(FIX, fixture)]) == 0
    out = capsys.readouterr().out
    assert ("No GPU found (no NVIDIA device on the PCI bus)" in out) == (not gpus)
    assert ("No RDMA device found" in out) == (not rdma)
    assert ("error: nics: auto found no RDMA device" in out) == (not rdma)


def test_live_json_parses_and_round_trips_through_a_tarball(tmp_path):
    res = run("--json")
    assert res.returncode == 0, res.stderr
    live = json.loads(res.stdout)
    assert sorted(g["bus_id"] for g in live["gpus"]) == host_gpus()
    assert sorted(d["name"] for d in live["rdma_devices"]) == host_rdma()
    assert live["numa_nodes"] and all(n["cpus"] for n in live["numa_nodes"])
    assert sorted(n["name"] for n in live["net_interfaces"]) == sorted(os.listdir("/sys/class/net"))
    errors = [p["error"] for p in live["placement"]]
    if host_rdma():
        assert not any("no RDMA device" in e for e in errors), errors
    else:
        assert "no RDMA device" in errors[0]
    tarball = str(tmp_path / "me.tar.gz")
    res = run("capture", tarball)
    assert res.returncode == 0 and "captured" in res.stdout, res.stderr
    res = run("--sysfs", tarball, "--json")
    assert res.returncode == 0, res.stderr
    back = json.loads(res.stdout)
    assert back.pop("sysfs_root") == tarball and live.pop("sysfs_root") == "/"
    assert back == live


def test_fixture_json_mapping(capsys):
    assert main(["--sysfs", os.path.join(FIX, "dgx-h100"), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    got = [(p["gpu"], p["cuda_ordinal"], p["nics"], p["distance"]) for p in data["placement"]]
    assert got[:2] == [("0000:1b:00.0", 0, ["mlx5_0"], {"mlx5_0": "PIX"}),
                       ("0000:20:00.0", 1, ["mlx5_1"], {"mlx5_1": "PIX"})]
    assert data["cuda"]["ordinals"]["7"] == "0000:c4:00.0"


def test_cuda_visible_devices_shown_by_bus_id(capsys, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "7,6")
    assert main(["--sysfs", os.path.join(FIX, "aws-p5")]) == 0
    out = capsys.readouterr().out
    assert "cuda:0 = 0000:de:00.0, cuda:1 = 0000:cd:00.0" in out
    assert "GPU 0000:de:00.0 (cuda:0) -> rdmap218s0 [PIX], rdmap219s0 [PIX]" in out
    assert "GPU 0000:4b:00.0 -> rdmap71s0 [PIX]" in out  # hidden from CUDA, still placed


@pytest.mark.parametrize("argv, code, text", [
    (["--gpu", "0000:1b:00.0", "--nics", "mlx5_99"], 1, "NIC 'mlx5_99' does not exist"),
    (["--gpu", "0000:99:00.0"], 2, "no GPU at PCI bus id '0000:99:00.0'"),
    (["--gpu", "0000:1b:00.0", "--nics", "mlx5_6"], 0,
     "explicit NIC list (distance from GPU 0000:1b:00.0: mlx5_6 SYS)"),
])
def test_user_errors_on_a_capture(argv, code, text, capsys):
    assert main(["--sysfs", os.path.join(FIX, "dgx-h100"), *argv]) == code
    out = capsys.readouterr()
    assert text in out.out + out.err


def test_bad_paths_are_clear_errors(tmp_path, capsys):
    assert main(["--sysfs", str(tmp_path / "nope")]) == 2
    assert "is not a directory" in capsys.readouterr().err
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    assert main(["capture", str(tmp_path / "full")]) == 2
    assert "already exists" in capsys.readouterr().err
