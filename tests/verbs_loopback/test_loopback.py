"""The loopback verbs device and pdkv's verbs transport on it, without RDMA hardware.

Every program that loads the loopback libibverbs.so.1 runs as a child process with
LD_LIBRARY_PATH set only in its environment; the pytest process never loads it (checked below).
The C programs print "FAIL <file>:<line>: <what>" on the first broken expectation.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from build import (  # noqa: E402
    LoopbackUnavailable,
    build_device_test,
    build_loopback_verbs,
    build_vtable_test,
    default_cache_dir,
)

REAL_LIB = Path("/usr/lib/x86_64-linux-gnu/libibverbs.so.1")
REQUIRE_VERBS = os.environ.get("PDKV_REQUIRE_VERBS") == "1"  # .ci/run: a skip here is a failure


def unavailable(reason: str):
    if REQUIRE_VERBS:
        pytest.fail(f"PDKV_REQUIRE_VERBS=1 but {reason}", pytrace=False)
    pytest.skip(reason)


@pytest.fixture(scope="module")
def build_dir() -> Path:
    return default_cache_dir()


@pytest.fixture(scope="module")
def lib_dir(build_dir) -> str:
    try:
        return build_loopback_verbs(build_dir)
    except LoopbackUnavailable as e:
        unavailable(f"loopback verbs device cannot be built here: {e}")


@pytest.fixture(scope="module")
def vtable_test(build_dir, lib_dir) -> str:
    return build_vtable_test(build_dir)


def has_rdma_devices() -> bool:
    sysfs = Path("/sys/class/infiniband")
    return sysfs.is_dir() and any(sysfs.iterdir())


def run(cmd: list[str], lib_dir: str | None, **extra_env) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "LD_LIBRARY_PATH"}
    if lib_dir is not None:
        env["LD_LIBRARY_PATH"] = lib_dir
    env.update(extra_env)
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)


def assert_ok(proc: subprocess.CompletedProcess, marker: str) -> None:
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0 and marker in proc.stdout, out
    # the loader warns for every symbol-versioned reference it cannot match
    assert "version information" not in out and "not found" not in proc.stderr, out
    assert "CQ overrun" not in proc.stderr, out  # the transport sized its CQ too small


def version_map(lib: Path) -> dict[str, str]:
    """{symbol: default version} of a shared library's dynamic symbols, from objdump -T."""
    text = subprocess.run(["objdump", "-T", str(lib)], capture_output=True, text=True,
                          check=True).stdout
    out = {}
    for line in text.splitlines():
        m = re.match(r".*\bDF \.text\s+\S+\s+(\(?)(\S+?)\)?\s+(\S+)$", line)
        if m and not m.group(1):  # "(IBVERBS_1.0)" marks a hidden, non-default version
            out[m.group(3)] = m.group(2)
    return out


@pytest.mark.skipif(not (shutil.which("objdump") and REAL_LIB.exists()),
                    reason="needs objdump and the real libibverbs to compare with")
def test_symbol_versions_match_the_real_library(lib_dir):
    ours = version_map(Path(lib_dir) / "libibverbs.so.1")
    real = version_map(REAL_LIB)
    assert "ibv_reg_mr_iova2" in ours and "ibv_post_send" not in ours  # post_send is inline
    for sym, ver in ours.items():
        if sym.startswith("pdkv_loopback_"):  # the device's own test-only exports (its counters)
            assert ver == "PDKV_LOOPBACK_1", sym
            continue
        assert real.get(sym) == ver, f"{sym}: loopback {ver}, real {real.get(sym)}"
    soname = subprocess.run(["objdump", "-p", str(Path(lib_dir) / "libibverbs.so.1")],
                            capture_output=True, text=True, check=True).stdout
    assert re.search(r"SONAME\s+libibverbs\.so\.1", soname)
    real_nodes = set(re.findall(r"IBVERBS_[\w.]+", subprocess.run(
        ["objdump", "-p", str(REAL_LIB)], capture_output=True, text=True).stdout))
    assert real_nodes <= set(re.findall(r"IBVERBS_[\w.]+", soname))


def test_device_semantics(build_dir, lib_dir):
    proc = run([build_device_test(build_dir)], lib_dir, PDKV_LOOPBACK_RNR_MS="200")
    assert_ok(proc, "OK device")


@pytest.mark.parametrize("scenario,qps,link", [
    ("writes", 1, "eth"), ("writes", 3, "eth"),  # random writes land byte-exact, imms exact
    ("writes", 2, "ib"),                          # the same over an InfiniBand (LID) port
    ("bad", 1, "eth"), ("bad", 2, "ib"),          # foreign key / out of range / overflow
    ("kill", 1, "eth"), ("kill", 2, "eth"),       # peer SIGKILLed mid-transfer, then restarted
    ("frozen", 2, "eth"),                         # peer SIGSTOPped: post never blocks
    ("errors", 1, "eth"),                         # bad options / connection data; destroy busy
])
def test_verbs_transport_vtable(vtable_test, lib_dir, scenario, qps, link):
    proc = run([vtable_test, scenario, str(qps)], lib_dir, PDKV_LOOPBACK_LINK=link)
    assert_ok(proc, f"OK {scenario}")


def test_unknown_nic_lists_the_available_ones(vtable_test, lib_dir):
    proc = run([vtable_test, "nodevice"], lib_dir, PDKV_LOOPBACK_NICS="nic_a,nic_b",
               PDKV_TEST_NIC="mlx5_7")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "NIC 'mlx5_7' not found; available: nic_a, nic_b" in proc.stdout


def test_real_library_without_rdma_is_a_clear_error(vtable_test):
    """No LD_LIBRARY_PATH: the real rdma-core library. Without RDMA in the kernel it returns
    NULL + ENOSYS from ibv_get_device_list, which must read as 'no RDMA device'."""
    has_rdma = has_rdma_devices()
    proc = run([vtable_test, "nodevice"], None)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    if has_rdma:
        assert "NIC 'lo_verbs0' not found; available:" in proc.stdout
    else:
        assert "verbs: no RDMA device" in proc.stdout, proc.stdout


def test_loopback_library_is_not_loaded_here(lib_dir):
    maps = Path("/proc/self/maps").read_text()
    assert lib_dir not in maps


def test_python_messenger_without_rdma_is_a_clear_error(lib_dir):
    """Through pdkv._messenger (built with verbs) on the real library: a clear exception, no
    silent tcp fallback. Runs in a child so a half-built extension cannot break this process."""
    code = (
        "import sys\n"
        "try:\n"
        "    from pdkv._messenger import HAVE_VERBS, Messenger, TransportUnavailableError\n"
        "    from pdkv.transports import VerbsOptions\n"
        "except ImportError as e:\n"
        "    print('SKIP', e); sys.exit(0)\n"
        "if not HAVE_VERBS:\n"
        "    print('SKIP pdkv built without libibverbs'); sys.exit(0)\n"
        "try:\n"
        "    Messenger('verbs', 1, VerbsOptions(nics=('lo_verbs0',)))\n"
        "except TransportUnavailableError as e:\n"
        "    print('RAISED', e)\n"
        "else:\n"
        "    print('CREATED')\n"
    )
    has_rdma = has_rdma_devices()
    proc = run([sys.executable, "-c", code], None)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    if proc.stdout.startswith("SKIP"):
        unavailable(proc.stdout.strip())
    assert proc.stdout.startswith("RAISED"), proc.stdout
    assert ("no RDMA device" if not has_rdma else "not found; available:") in proc.stdout
