"""tools/topo --probe and pdkv serve's start-up check, on the loopback verbs device.

Every probe runs in a child process with the loopback device on its LD_LIBRARY_PATH, through
both backends: rdma-core's pyverbs (skipped, with the reason, only where pyverbs cannot be
imported) and pdkv's own verbs messenger. Faults are injected by the device
(PDKV_LOOPBACK_FAULTS: port_down, no_dmabuf, no_peermem) or by the OS (RLIMIT_MEMLOCK lowered
with resource.setrlimit, CAP_IPC_LOCK dropped, in the child); each must give the line that
names the fix. GPU memory is a test stand-in (a memfd as the dma-buf, an address nobody mapped
as the device pointer), which the loopback device treats as such.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
TOOL = str(ROOT / "tools" / "topo")
DGX = str(ROOT / "tests" / "topo" / "fixtures" / "dgx-h100")

# In the child: drop CAP_IPC_LOCK (root ignores the limit with it), lower RLIMIT_MEMLOCK to
# argv[1] KiB, then run tools/topo --probe with the remaining arguments.
MEMLOCK_CHILD = textwrap.dedent("""
    import ctypes, resource, sys
    class Hdr(ctypes.Structure):
        _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]
    class Data(ctypes.Structure):
        _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32),
                    ("inheritable", ctypes.c_uint32)]
    libc = ctypes.CDLL(None, use_errno=True)
    hdr, data = Hdr(0x20080522, 0), (Data * 2)()
    assert libc.capget(ctypes.byref(hdr), data) == 0
    data[0].effective &= ~(1 << 14)
    data[0].permitted &= ~(1 << 14)
    assert libc.capset(ctypes.byref(hdr), data) == 0, ctypes.get_errno()
    kib = int(sys.argv[1])
    resource.setrlimit(resource.RLIMIT_MEMLOCK, (kib << 10, kib << 10))
    from pdkv.probe.cli import main
    sys.exit(main(sys.argv[2:]))
""")

# TEST STAND-IN for GPU memory: its "dma-buf" is a memfd (the loopback's ibv_reg_dmabuf_mr maps
# it), its "device pointer" an address this process never mapped (no_peermem refuses it).
STANDIN_CHILD = textwrap.dedent("""
    import json, os, sys
    from pdkv.probe.run import run_probe
    class MemfdDeviceMemory:
        label = "stand-in GPU"
        ptr, nbytes = 0x7e0000000000, 2 << 20
        def __init__(self):
            self.fd = os.memfd_create("pdkv-probe-standin")
            os.ftruncate(self.fd, self.nbytes)
        def dmabuf_fd(self):
            return os.dup(self.fd)
        def close(self):
            os.close(self.fd)
    mem = MemfdDeviceMemory()
    out = [run_probe((), 0, "host memory", sys.argv[1], mem, "", required).to_dict()
           for required in (False, True)]  # GPUDirect optional (staged KV), then required
    mem.close()
    print(json.dumps(out))
""")


@pytest.fixture(scope="module")
def pyverbs_reason(loopback_verbs_dir):
    """None where pyverbs imports in a child, else why not."""
    out = subprocess.run([sys.executable, "-c", "from pdkv.probe.via_pyverbs import load_pyverbs as l\n"
                          "pv, why = l()\nprint('' if pv else why)"], capture_output=True, text=True,
                         timeout=120, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.returncode == 0, out.stderr
    return out.stdout.strip() or None


@pytest.fixture(params=["pyverbs", "messenger"])
def backend(request, pyverbs_reason):
    if request.param == "pyverbs" and pyverbs_reason:
        pytest.skip(f"the pyverbs path needs pyverbs, which cannot be imported here: {pyverbs_reason}")
    return request.param


def _env(lib_dir, nics="", faults=""):
    env = {**os.environ, "LD_LIBRARY_PATH": lib_dir, "PYTHONPATH": str(ROOT),
           "PDKV_LOOPBACK_FAULTS": faults}
    env.pop("PDKV_LOOPBACK_NICS", None)
    if nics:
        env["PDKV_LOOPBACK_NICS"] = nics
    return env


def probe(lib_dir, *args, nics="", faults="", memlock_kib=None):
    cmd = [sys.executable, TOOL, "--probe", *args]
    if memlock_kib is not None:
        cmd = [sys.executable, "-c", MEMLOCK_CHILD, str(memlock_kib), "--probe", *args]
    return subprocess.run(cmd, cwd=ROOT, env=_env(lib_dir, nics, faults), capture_output=True, text=True,
                          timeout=180)


def test_the_loopback_device_is_seen_and_passes(loopback_verbs_dir, backend):
    r = probe(loopback_verbs_dir, "--backend", backend, "--bytes", "64MiB", "--json")
    assert r.returncode == 0, r.stdout + r.stderr
    out = json.loads(r.stdout)
    assert out["ok"] and [d["name"] for d in out["devices"]] == ["lo_verbs0"]
    dev = out["devices"][0]
    assert dev["ok"] and dev["backend"] == backend and dev["host_bytes"] == 64 << 20
    assert any("RDMA WRITE of 4096 bytes" in c for c in dev["checks"]), dev["checks"]
    assert dev["line"].startswith("lo_verbs0 port 1: OK (")
    if backend == "pyverbs":  # queried for real: the device's port, its RoCE v2 GID, its limits
        (port,) = dev["ports"]
        assert (port["state"], port["link_layer"], port["active_mtu"]) == ("ACTIVE", "Ethernet", 4096)
        assert port["rate"] == "4X EDR (100 Gb/s)"
        assert [g["type"] for g in port["gids"]] == ["RoCE v2"]
        assert port["gids"][0]["gid"].startswith("0000:0000:0000:0000:0000:ffff:7f")
        assert dev["attrs"]["max_qp"] == 1 << 16 and dev["attrs"]["max_cqe"] == 1 << 22
        assert "pyverbs" in out["backend"]


def test_a_port_down_is_named_with_the_fix(loopback_verbs_dir, backend):
    r = probe(loopback_verbs_dir, "--backend", backend, nics="lo_a,lo_b", faults="port_down=2")
    assert r.returncode == 1, r.stdout + r.stderr
    lines = r.stdout.splitlines()
    assert any(line.startswith("lo_a port 1: OK") for line in lines), r.stdout
    (bad,) = [line for line in lines if line.startswith("lo_b port 1:")]
    assert "NOT USABLE" in bad and "port 1 is DOWN" in bad and "ip link set" in bad, bad


def test_a_low_memlock_limit_names_rlimit_memlock_and_the_number(loopback_verbs_dir, backend):
    r = probe(loopback_verbs_dir, "--backend", backend, "--bytes", "1GiB", memlock_kib=64)
    assert r.returncode == 1, r.stdout + r.stderr
    (line,) = [x for x in r.stdout.splitlines() if x.startswith("lo_verbs0")]
    assert "RLIMIT_MEMLOCK allows this process 64 KiB" in line, line
    assert "ulimit -l 1048576" in line and "LimitMEMLOCK=infinity" in line and "CAP_IPC_LOCK" in line
    # the same limit with a region that fits is fine; with no size to check, the limit is a note
    assert probe(loopback_verbs_dir, "--backend", backend, "--bytes", "32KiB", memlock_kib=64).returncode == 0
    r = probe(loopback_verbs_dir, "--backend", backend, memlock_kib=64)
    assert r.returncode == 0 and "note: RLIMIT_MEMLOCK is 64 KiB (no CAP_IPC_LOCK)" in r.stdout, r.stdout


@pytest.mark.parametrize("faults, methods", [("", "dma-buf and nvidia-peermem"),
                                             ("no_dmabuf", "nvidia-peermem"),
                                             ("no_dmabuf,no_peermem", "none")])
def test_gpudirect_says_which_way_registers_device_memory(loopback_verbs_dir, backend, faults, methods):
    r = subprocess.run([sys.executable, "-c", STANDIN_CHILD, backend], cwd=ROOT, capture_output=True,
                       text=True, timeout=180, env=_env(loopback_verbs_dir, faults=faults))
    assert r.returncode == 0, r.stderr
    optional, required = json.loads(r.stdout)
    (dev,) = optional["devices"]
    assert dev["ok"] and dev["gpudirect"] == f"stand-in GPU: {methods}", dev
    notes = " ".join(dev["notes"])
    assert ("ibv_reg_dmabuf_mr failed" in notes) == ("no_dmabuf" in faults), notes
    assert ("on the device pointer failed" in notes) == ("no_peermem" in faults), notes
    # where the KV cannot be staged (messenger.staging off), no way is a NIC that cannot be used
    (dev,) = required["devices"]
    assert dev["ok"] == (methods != "none"), dev
    if methods == "none":
        assert "GPUDirect RDMA is required" in dev["line"] and "messenger.staging auto" in dev["line"]


def _verbs_config(tmp_path, model_dir, nics, **kv) -> str:
    cfg = {"role": "prefill", "model": {"path": str(model_dir)},
           "kv_cache": {"page_size": 4, **kv}, "scheduler": {"max_num_seqs": 4},
           "server": {"port": 0}, "messenger": {"transport": "verbs", "nics": list(nics), "control_port": 0}}
    path = tmp_path / "verbs.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return str(path)


def test_a_config_probes_the_nics_its_node_opens_with_its_kv_cache(loopback_verbs_dir, tmp_path,
                                                                   tiny_model_dir):
    from pdkv.config import load_config
    from pdkv.probe import config_needs

    cfg_path = _verbs_config(tmp_path, tiny_model_dir, ["lo_b"], num_pages=96)
    needs = config_needs(load_config(cfg_path))
    r = probe(loopback_verbs_dir, "-c", cfg_path, "--json", nics="lo_a,lo_b", faults="port_down=1")
    assert r.returncode == 0, r.stdout + r.stderr  # lo_a is down, but the node opens only lo_b
    (dev,) = json.loads(r.stdout)["devices"]
    assert dev["name"] == "lo_b" and dev["ok"] and dev["host_bytes"] == needs.host_bytes > 0
    tcp = probe(loopback_verbs_dir, "-c", cfg_path, "--set", "messenger.transport=tcp")
    assert tcp.returncode == 2 and "opens no RDMA NIC" in tcp.stderr, tcp.stderr


@pytest.mark.parametrize("kv", [{"num_pages": 96}, {"memory_gib": 0.0001}, {"memory_gib": 8}])
def test_the_registered_size_is_the_kv_cache_the_engine_makes(tmp_path, tiny_model_dir, kv):
    from pdkv.config import load_config
    from pdkv.engine.factory import build_parts
    from pdkv.probe.needs import kv_cache_bytes

    cfg = load_config(_verbs_config(tmp_path, tiny_model_dir, ["lo_verbs0"], **kv))
    parts = build_parts(cfg.model, cfg.kv_cache, cfg.scheduler)
    assert kv_cache_bytes(cfg) == parts.kv.nbytes


def test_the_messenger_backend_takes_port_facts_from_sysfs(loopback_verbs_dir):
    # the DGX fixture's storage NICs, played by loopback devices of the same names: the probe
    # resolves an interface name to its NIC and reports sysfs's MTU / GID / port-state mistakes
    r = probe(loopback_verbs_dir, "--backend", "messenger", "--sysfs", DGX, "--nics", "enp91s0f1np1,mlx5_11",
              nics="mlx5_5,mlx5_11")
    assert r.returncode == 1, r.stdout + r.stderr
    (ok,) = [x for x in r.stdout.splitlines() if x.startswith("mlx5_5 ")]
    assert "OK" in ok and "RoCE path MTU 1024: set enp91s0f1np1's MTU to 4200" in ok, ok
    assert "no routable RoCE v2 GID" in ok
    (down,) = [x for x in r.stdout.splitlines() if x.startswith("mlx5_11 ")]
    assert "port 1 is DOWN (physical state Disabled)" in down and "ip link set enp217s0f1np1 up" in down


def test_no_device_and_an_unknown_nic(loopback_verbs_dir, backend):
    r = probe(loopback_verbs_dir, "--backend", backend, "--nics", "mlx5_9")
    assert r.returncode == 1 and "no RDMA device named 'mlx5_9' (available: lo_verbs0)" in r.stdout, r.stdout
    if os.path.isdir("/sys/class/infiniband") and os.listdir("/sys/class/infiniband"):
        return  # a host with RDMA devices: the real library lists them
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("LD_LIBRARY_PATH", None)  # the real libibverbs on a host without RDMA devices
    r = subprocess.run([sys.executable, TOOL, "--probe", "--backend", backend], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and "NOT USABLE: no RDMA device" in r.stdout, r.stdout + r.stderr


def test_serve_refuses_to_start_before_loading_weights(loopback_verbs_dir, tmp_path, tiny_model_dir):
    cfg_path = _verbs_config(tmp_path, tiny_model_dir, ["lo_verbs0"], num_pages=64)
    r = subprocess.run([sys.executable, "-m", "pdkv", "serve", "-c", cfg_path], cwd=ROOT, capture_output=True,
                       text=True, timeout=300, env=_env(loopback_verbs_dir, faults="port_down=1"))
    assert r.returncode == 1, r.stderr
    assert "messenger.transport verbs cannot use this host's NICs: lo_verbs0 port 1: NOT USABLE: port 1 is " \
           "DOWN" in r.stderr, r.stderr
    assert f"tools/topo --probe -c {cfg_path}" in r.stderr
    assert "loading" not in r.stderr  # refused before the weights


def test_port_verdicts_name_the_fix():
    # the verdicts the loopback device cannot play (it is always RoCE v2 or IB with a LID)
    from pdkv.probe.checks import port_problems
    from pdkv.probe.report import GidInfo, PortInfo, rate

    ib = PortInfo(1, "INIT", "LinkUp", "InfiniBand", rate(128, 2), 4096, 4096, 0)
    (p,), _ = port_problems("mlx5_0", 1, ib, 1, None)
    assert "port 1 is INIT" in str(p) and "opensm" in str(p)
    no_lid = PortInfo(1, "ACTIVE", "LinkUp", "InfiniBand", "", 4096, 4096, 0)
    (p,), _ = port_problems("mlx5_0", 1, no_lid, 1, None)
    assert "has no LID" in str(p) and "subnet manager" in str(p)
    no_gid = PortInfo(1, "ACTIVE", "LinkUp", "Ethernet", "", 1024, 4096, 0)
    (p,), _ = port_problems("mlx5_4", 1, no_gid, 1, "eth2")
    assert "empty GID table" in str(p) and "ip addr add ADDR/PREFIX dev eth2" in str(p)
    v1 = PortInfo(1, "ACTIVE", "LinkUp", "Ethernet", "", 1024, 4096, 0,
                  (GidInfo(0, "fe80:0000:0000:0000:0a4e:2bff:fe11:0001", "RoCE v1"),))
    problems, notes = port_problems("mlx5_4", 1, v1, 1, "eth2")
    assert not problems and any("path MTU 1024" in n for n in notes) and any("RoCE v2" in n for n in notes)
    (p,), _ = port_problems("mlx5_4", 2, None, 1, None)
    assert "no port 2 (1 port(s))" in str(p)
    assert (ib.rate, rate(64, 2), rate(16, 2), rate(4, 1)) == (
        "4X NDR (400 Gb/s)", "4X HDR (200 Gb/s)", "4X FDR (56 Gb/s)", "1X QDR (10 Gb/s)")


def test_the_fastest_path_from_each_gpu_carries_the_verdicts(loopback_verbs_dir):
    # the DGX fixture's compute NICs mlx5_0 / mlx5_1 (under the first two GPUs' PCIe switches),
    # played by loopback devices, the second with its port down
    r = probe(loopback_verbs_dir, "--backend", "messenger", "--sysfs", DGX, "--nics", "mlx5_0,mlx5_1",
              "--cuda", "off", "--json", nics="mlx5_0,mlx5_1", faults="port_down=2")
    assert r.returncode == 1, r.stdout + r.stderr
    paths = json.loads(r.stdout)["gpu_paths"]
    assert len(paths) == 8
    assert paths[0]["gpu"] == "0000:1b:00.0" and paths[0]["nics"] == [
        {"name": "mlx5_0", "distance": "PIX", "verdict": "OK"}]
    assert paths[1]["nics"] == [{"name": "mlx5_1", "distance": "PIX", "verdict": "NOT USABLE"}]
    assert paths[2]["nics"][0]["verdict"] == "not probed"


def test_a_pyverbs_for_another_python_is_named_not_loaded(tmp_path, monkeypatch):
    import importlib.util

    from pdkv.probe import via_pyverbs

    if importlib.util.find_spec("pyverbs") is not None:
        pytest.skip("pyverbs is importable from sys.path here: the fallback is not reached")
    pkg = tmp_path / "pyverbs"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("raise AssertionError('must not be executed')\n")
    (pkg / "device.cpython-39-x86_64-linux-gnu.so").write_bytes(b"")
    monkeypatch.setattr(via_pyverbs, "SYSTEM_DIRS", (str(tmp_path),))
    pv, why = via_pyverbs.load_pyverbs()
    assert pv is None and "built for another Python" in why and "`import pyverbs` failed" in why
    monkeypatch.setattr(via_pyverbs, "SYSTEM_DIRS", (str(tmp_path / "none"),))
    pv, why = via_pyverbs.load_pyverbs()
    assert pv is None and "apt-get install python3-pyverbs" in why


def test_a_registration_the_kernel_refuses_names_the_limit(loopback_verbs_dir, backend):
    # the limit allows the region, but the kernel still cannot pin it (other memory this process
    # pinned counts too): the failed registration itself names RLIMIT_MEMLOCK and the number
    r = probe(loopback_verbs_dir, "--backend", backend, "--bytes", "3MiB", memlock_kib=4096,
              faults=f"reg_enomem_len={3 << 20}")
    assert r.returncode == 1, r.stdout + r.stderr
    (line,) = [x for x in r.stdout.splitlines() if x.startswith("lo_verbs0")]
    assert "RLIMIT_MEMLOCK allows this process 4096 KiB" in line and "ulimit -l 3072" in line, line
    # without a binding limit (root keeps CAP_IPC_LOCK here) the line says where else to look
    r = probe(loopback_verbs_dir, "--backend", backend, "--bytes", "3MiB", faults=f"reg_enomem_len={3 << 20}")
    (line,) = [x for x in r.stdout.splitlines() if x.startswith("lo_verbs0")]
    if "RLIMIT_MEMLOCK does not bind" in line:
        assert "memory cgroup" in line, line
    else:
        assert "RLIMIT_MEMLOCK allows this process" in line, line


def test_without_cuda_the_gpudirect_check_says_why_and_the_nic_passes(loopback_verbs_dir):
    from pdkv.gpu.guard import gpu_unavailable_reason

    reason = gpu_unavailable_reason(0, need_torch=False)
    if reason is None:
        pytest.skip("CUDA is available here: the real GPUDirect path runs instead")
    r = probe(loopback_verbs_dir, "--backend", "messenger", "--cuda", "0", "--json")
    assert r.returncode == 0, r.stdout + r.stderr
    out = json.loads(r.stdout)
    assert out["ok"] and out["gpu"] == "" and out["devices"][0]["gpudirect"] == ""
    assert f"GPUDirect not checked: {reason}" in out["notes"], out["notes"]
