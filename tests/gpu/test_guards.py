"""The GPU paths fail clearly where they cannot run, and importing them costs nothing.

On a machine without a GPU every GPU entry point must raise GPUUnavailable naming what is
missing. Two of the three causes (cuda-python absent, no device) cannot be produced for real on
a given machine, so they are reached by fault injection: a module table without ``cuda`` and a
``FakeDriverNoDevice`` standing in for cuda-python's driver module. The "no driver" cause is
the real state of CPU machines and is checked for real there.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import pdkv.gpu
from pdkv.gpu import guard
from pdkv.gpu.cumem import CuMemAllocation, CuMemInfo
from pdkv.gpu.guard import CudaError, GPUUnavailable
from pdkv.gpu.layer_counter import CudaLayerCounter, make_layer_counter

REPO = Path(__file__).resolve().parents[2]
REASONS = ("cuda-python is not installed", "no NVIDIA driver", "no CUDA device", "built without CUDA",
           "sees no CUDA device")
HAVE_GPU = pdkv.gpu.gpu_unavailable_reason() is None
cpu_only = pytest.mark.skipif(HAVE_GPU, reason="this machine has a usable GPU")


def test_importing_pdkv_gpu_imports_neither_cuda_python_nor_torch():
    code = (f"import sys; sys.path.insert(0, {str(REPO / 'tools')!r})\n"
            "import pdkv.gpu, pdkv.gpu.cumem, pdkv.gpu.layer_counter, pdkv.gpu.fdpass, "
            "gpu_check_selftest, pdkv.gpu.staging, pdkv.gpu.copy_engine, pdkv.gpu.cpu_copy_engine, "
            "pdkv.gpu.cuda_copy_engine, pdkv.gpu.gpudirect, pdkv.gpu.compute_mode, gpu_check_copy\n"
            "print(sorted(m for m in sys.modules if m == 'torch' or m == 'cuda' or m.startswith('cuda.')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         env=dict(os.environ, PYTHONPATH=str(REPO)), check=True).stdout
    assert out.strip() == "[]"


def _entry_points():
    from pdkv.gpu.cumem import CuMemAllocation, CuMemInfo
    from pdkv.gpu.layer_counter import CudaLayerCounter, make_layer_counter
    from gpu_check_selftest import check_counter_graph, check_cumem_two_process

    info = CuMemInfo(2 << 20, 1 << 20, "0000:00:00.0")
    return {
        "CuMemAllocation.allocate": lambda: CuMemAllocation.allocate(1 << 20),
        "CuMemAllocation.import_fd": lambda: CuMemAllocation.import_fd(0, info),
        "CudaLayerCounter": lambda: CudaLayerCounter(0),
        "make_layer_counter": lambda: make_layer_counter("cuda:0"),
        "check_cumem_two_process": check_cumem_two_process,
        "check_counter_graph": check_counter_graph,
    }


@cpu_only
@pytest.mark.parametrize("name", list(_entry_points()))
def test_gpu_entry_points_raise_gpu_unavailable_naming_the_cause(name):
    with pytest.raises(GPUUnavailable) as e:
        _entry_points()[name]()
    msg = str(e.value)
    assert "needs a GPU" in msg and any(r in msg for r in REASONS), msg


@cpu_only
def test_no_driver_is_named_with_the_library_that_is_missing():
    try:
        import ctypes
        ctypes.CDLL("libcuda.so.1")
        pytest.skip("libcuda.so.1 loads here: the driver is installed")
    except OSError:
        pass
    with pytest.raises(GPUUnavailable, match=r"CuMemAllocation.allocate needs a GPU: no NVIDIA driver: libcuda.so.1"):
        CuMemAllocation.allocate(1 << 20)


def test_missing_cuda_python_is_named(monkeypatch):
    # fault injection: a module table in which `cuda` cannot be imported
    for name in [m for m in sys.modules if m == "cuda" or m.startswith("cuda.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "cuda", None)
    with pytest.raises(GPUUnavailable, match=r"CudaLayerCounter needs a GPU: cuda-python is not installed.*pip install cuda-python"):
        CudaLayerCounter(0)


class FakeDriverNoDevice:
    """Fault injection: cuda-python's driver module on a host whose driver finds no GPU
    (cuInit -> CUDA_ERROR_NO_DEVICE), or finds ``count`` GPUs when built with ``count``."""

    def __init__(self, count: int | None = None, driver_version: int = 13000):
        self.count, self.driver_version = count, driver_version

    def cuDriverGetVersion(self):
        return (0, self.driver_version)

    def cuInit(self, flags):
        return (0,) if self.count is not None else (guard.CUDA_ERROR_NO_DEVICE,)

    def cuDeviceGetCount(self):
        return (0, self.count)

    def cuGetErrorName(self, err):
        return (0, {100: b"CUDA_ERROR_NO_DEVICE"}.get(int(err), b"CUDA_ERROR_UNKNOWN"))


@pytest.mark.parametrize("count, device, expected", [
    (None, None, r"no CUDA device: cuInit returned CUDA_ERROR_NO_DEVICE \(CUDA_VISIBLE_DEVICES="),
    (0, None, r"no CUDA device is visible"),
    (1, 3, r"cuda:3 does not exist: 1 device\(s\) visible"),
])
def test_no_device_is_named(monkeypatch, count, device, expected):
    monkeypatch.setattr(guard, "_load_bindings", lambda: FakeDriverNoDevice(count))
    monkeypatch.setattr(guard, "_load_libcuda", lambda: None)
    with pytest.raises(GPUUnavailable, match=r"CuMemAllocation.allocate needs a GPU: " + expected):
        guard.cuda_driver("CuMemAllocation.allocate", device)
    assert guard.gpu_unavailable_reason(device or 0, need_torch=False) is not None


def test_a_working_fake_driver_passes_the_guard(monkeypatch):
    # the guard must not refuse a host that has what it needs (else every GPU test would skip)
    monkeypatch.setattr(guard, "_load_bindings", lambda: FakeDriverNoDevice(2))
    monkeypatch.setattr(guard, "_load_libcuda", lambda: None)
    assert isinstance(guard.cuda_driver("x", 1), FakeDriverNoDevice)
    assert guard.gpu_unavailable_reason(1, need_torch=False) is None


def test_cpu_build_of_torch_is_named():
    import torch

    if torch.version.cuda is not None:
        pytest.skip(f"torch {torch.__version__} has CUDA here")
    with pytest.raises(GPUUnavailable, match=r"CuMemAllocation.tensor needs a GPU: torch .* was built without CUDA"):
        guard.require_torch_cuda("CuMemAllocation.tensor", 0)


def test_failed_driver_call_names_the_call_and_the_error():
    class Driver:  # fault injection: a driver whose calls fail with CUDA_ERROR_OUT_OF_MEMORY
        @staticmethod
        def cuGetErrorName(err):
            return (0, b"CUDA_ERROR_OUT_OF_MEMORY")

    def cuMemCreate(size, prop, flags):
        return (2, None)

    with pytest.raises(CudaError, match=r"cuMemCreate\(4294967296, object, 0\) failed: CUDA_ERROR_OUT_OF_MEMORY") as e:
        guard.call(Driver, cuMemCreate, 1 << 32, object(), 0)
    assert e.value.code == 2
    assert guard.call(Driver, lambda: (0, 7)) == 7 and guard.call(Driver, lambda: (0,)) is None


def test_bad_arguments_are_refused_before_touching_cuda():
    with pytest.raises(ValueError, match="size must be >= 1 byte, got 0"):
        CuMemAllocation.allocate(0)
    with pytest.raises(ValueError, match="device must be 'cpu' or 'cuda"):
        make_layer_counter("tpu:0")
    with pytest.raises(ValueError, match="lacks or garbles 'bus_id'"):
        CuMemInfo.from_header({"nbytes": 4, "size": 4})
    with pytest.raises(ValueError, match="size 9 must be in 1..nbytes"):
        CuMemInfo.from_header({"nbytes": 4, "size": 9, "bus_id": "x"})


@pytest.mark.parametrize("driver, bindings, expected", [
    (12080, "13.4.4", r'cuda-bindings 13.4.4 is for CUDA 13 drivers \(>= 580.65.06\), but this driver supports '
                      r'CUDA 12.8: install the matching bindings with `pip install "cuda-python>=12.6,<13"`'),
    (11040, "12.9.0", r'supports CUDA 11.4: .*`pip install "cuda-python>=11.8,<12"`, or upgrade the NVIDIA '
                      r'driver to >= 525.60.13'),
    (12020, "14.0.1", r'cuda-bindings 14.0.1 is for CUDA 14 drivers \(>= one for CUDA 14\)'),
])
def test_bindings_newer_than_the_driver_are_refused_naming_the_install(driver, bindings, expected):
    with pytest.raises(GPUUnavailable, match=expected):
        guard.check_driver_version(driver, bindings)


@pytest.mark.parametrize("driver, bindings", [(13000, "13.4.4"), (13010, "12.9.2"), (12080, "12.6.0"),
                                              (12090, "12.9.1.post1")])
def test_bindings_of_the_drivers_major_or_older_pass(driver, bindings):
    guard.check_driver_version(driver, bindings)  # no exception: older bindings on newer drivers work


def test_an_unreadable_bindings_version_is_named():
    with pytest.raises(GPUUnavailable, match="cannot read the cuda-bindings version 'garbage'"):
        guard.check_driver_version(13000, "garbage")


def test_the_guard_compares_versions_before_cuinit(monkeypatch):
    # fault injection: a CUDA 12.4 driver under cuda-bindings 13 (cuInit would even succeed)
    monkeypatch.setattr(guard, "_load_bindings", lambda: FakeDriverNoDevice(1, driver_version=12040))
    monkeypatch.setattr(guard, "_load_libcuda", lambda: None)
    monkeypatch.setattr(guard, "bindings_version", lambda drv=None: "13.4.4")
    with pytest.raises(GPUUnavailable, match=r'CudaLayerCounter needs a GPU: cuda-bindings 13.4.4 .* CUDA 12.4: '
                                             r'.*pip install "cuda-python>=12.6,<13"'):
        guard.cuda_driver("CudaLayerCounter")
    monkeypatch.setattr(guard, "bindings_version", lambda drv=None: "12.9.0")
    assert isinstance(guard.cuda_driver("CudaLayerCounter"), FakeDriverNoDevice)


def test_installed_bindings_version_is_read():
    version = guard.bindings_version()
    assert version.split(".")[0].isdigit(), version


def test_missing_numpy_is_named(monkeypatch):
    monkeypatch.setitem(sys.modules, "numpy", None)  # fault injection: numpy cannot be imported
    with pytest.raises(GPUUnavailable, match=r"CuMemAllocation.tensor needs numpy \(torch reads "
                                             r"__cuda_array_interface__ through it\).*pip install numpy"):
        guard.require_numpy("CuMemAllocation.tensor")


def test_a_broken_numpy_bridge_is_named(monkeypatch):
    import torch

    def no_bridge(array):  # fault injection: what torch raises when built against another numpy
        raise RuntimeError("Numpy is not available")

    monkeypatch.setattr(torch, "from_numpy", no_bridge)
    with pytest.raises(GPUUnavailable, match=r"needs torch's numpy bridge, which fails with numpy .* "
                                             r"\(Numpy is not available\)"):
        guard.require_numpy("CudaLayerCounter")


def test_numpy_present_passes():
    guard.require_numpy("x")  # numpy is a dependency (requirements.txt): this must not raise
