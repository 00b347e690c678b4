"""tools/gpu_check.py off the GPU: a clean "no GPU" run, and the runner's bookkeeping (statuses,
summary, exit status, budget, compute mode, isolated checks) driven by stand-in checks.

Also the GPU checks' own logic that needs no GPU: the copy engine check's byte comparison and
streaming, run on the CPU engine, and the weight bytes of the Qwen2.5-0.5B shape.
"""

from __future__ import annotations

import importlib
import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pdkv.gpu import gpu_unavailable_reason

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tools"))
gpu_check = importlib.import_module("gpu_check")
HAVE_GPU = gpu_unavailable_reason() is None


@pytest.mark.skipif(HAVE_GPU, reason="this machine has a usable GPU")
def test_without_a_gpu_the_tool_says_so_skips_everything_and_exits_0(tmp_path):
    out_json = tmp_path / "r.json"
    proc = subprocess.run([sys.executable, str(REPO / "tools/gpu_check.py"), "--json", str(out_json)],
                          capture_output=True, text=True, timeout=120, cwd=tmp_path,
                          env=dict(os.environ, PYTHONPATH=str(REPO)))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "no GPU: " in proc.stdout and "every check is skipped" in proc.stdout
    report = json.loads(out_json.read_text())
    assert report["no_gpu"] and report["failed"] == 0 and report["passed"] == 0
    assert [c["name"] for c in report["checks"]] == [c.name for c in gpu_check.CHECKS]
    assert all(c["status"] == "SKIP" and c["detail"] == "no GPU on this machine" for c in report["checks"])
    assert proc.stdout.strip().splitlines()[-2] == f"0 passed, 0 failed, {len(gpu_check.CHECKS)} skipped"


def _skip():
    raise gpu_check.Skip("nothing to do here")


def _boom():
    raise RuntimeError("the device fell off the bus")


def test_statuses_summary_and_exit_status(capsys):
    checks = [gpu_check.Check("guard", lambda: "fine"), gpu_check.Check("a", lambda: ("ok", {"x": 1})),
              gpu_check.Check("b", _skip), gpu_check.Check("c", _boom)]
    results = gpu_check.run_checks(checks, budget=1e9)
    assert [(r.name, r.status) for r in results] == [("guard", "PASS"), ("a", "PASS"), ("b", "SKIP"), ("c", "FAIL")]
    assert results[1].data == {"x": 1} and results[3].detail == "RuntimeError: the device fell off the bus"
    assert "Traceback" in capsys.readouterr().out  # printed when the check failed
    lines = gpu_check.summary(results)
    assert lines[-1] == "2 passed, 1 failed, 1 skipped" and len(lines) == 2 + len(checks) + 1
    assert lines[5].startswith("FAIL c (") and "fell off the bus" in lines[5]
    assert gpu_check.exit_code(results) == 1
    assert gpu_check.exit_code([r for r in results if r.status != "FAIL"]) == 0  # SKIP is not a failure


def test_a_failed_guard_skips_the_rest_and_the_budget_skips_late_checks():
    ran = []
    checks = [gpu_check.Check("guard", _boom), gpu_check.Check("a", lambda: ran.append("a") or "ok")]
    results = gpu_check.run_checks(checks, budget=1e9)
    assert [r.status for r in results] == ["FAIL", "SKIP"] and ran == []
    assert results[1].detail == "the guard failed: nothing else can run"
    checks = [gpu_check.Check("guard", lambda: "ok"), gpu_check.Check("slow", lambda: "ok")]
    results = gpu_check.run_checks(checks, budget=-1.0)
    assert results[1].status == "SKIP" and "time budget of -1 s used up" in results[1].detail


def test_two_process_checks_are_skipped_naming_the_compute_mode():
    from pdkv.gpu.compute_mode import problem

    ran = []
    checks = [gpu_check.Check("guard", lambda: "ok"),
              gpu_check.Check("two", lambda: ran.append(1) or "ok", frozenset({"multiprocess"})),
              gpu_check.Check("one", lambda: "ok")]
    results = gpu_check.run_checks(checks, 1e9, mode_problem=lambda: problem("Exclusive_Process"))
    assert [r.status for r in results] == ["PASS", "SKIP", "PASS"] and ran == []
    assert "compute mode is Exclusive_Process" in results[1].detail
    results = gpu_check.run_checks(checks, 1e9, mode_problem=lambda: problem("Default"))
    assert [r.status for r in results] == ["PASS", "PASS", "PASS"]


@pytest.mark.skipif(HAVE_GPU, reason="the guard passes on a GPU machine")
def test_an_isolated_check_reports_its_childs_failure():
    check = gpu_check.Check("guard", gpu_check.dev.check_guard, isolate=120.0)
    result = gpu_check.run_one(check)
    assert result.status == "FAIL" and "needs a GPU" in result.detail, result


def test_unknown_check_names_are_refused(capsys):
    with pytest.raises(SystemExit):
        gpu_check.main(["--only", "nope"])
    assert "unknown check 'nope'" in capsys.readouterr().err


def test_the_qwen25_05b_shape_has_its_published_parameter_count():
    from gpu_check_models import QWEN25_05B, random_model, weight_bytes

    model, arch = random_model(QWEN25_05B, torch.bfloat16, "meta")
    assert arch.num_layers == 24 and arch.head_dim == 64 and arch.num_kv_heads == 2
    assert sum(p.numel() for p in model.parameters()) == 494_032_768  # the model card's 0.49B
    assert weight_bytes(model) == 2 * 494_032_768


def test_the_copy_engine_checks_logic_on_the_cpu_engine():
    from pdkv.gpu.cpu_copy_engine import CpuCopyEngine
    from gpu_check_copy import _exact, _stream_rate
    from pdkv.gpu.staging import Span, StagingRing

    page = 4096
    dev = torch.randint(0, 256, (256 * page,), dtype=torch.uint8)
    engine = CpuCopyEngine(StagingRing(4, 8 * page), dev)
    try:
        checked = _exact(torch, engine, dev, random.Random(1), page, num_jobs=16)
        assert checked > 16 * page
        jobs = [tuple(Span((j * 8 + k) * page, page) for k in range(8)) for j in range(32)]
        assert _stream_rate(engine, jobs) > 0
        assert engine.ring.owners() == {} and engine.num_jobs() == 0
    finally:
        engine.close()


def test_the_disagg_gpu_check_is_skipped_while_the_config_refuses_cuda_roles():
    from gpu_check_models import SkipCheck, check_disagg_gpu

    from pdkv.config import ConfigError, load_config

    try:
        load_config(REPO / "configs/prefill.yaml", ["model.device=cuda"], check_paths=False)
    except ConfigError:
        with pytest.raises(SkipCheck, match=r"the roles do not take KV on the GPU yet .*model.device must be cpu "
                                             r"for role prefill"):
            check_disagg_gpu()
    else:
        pytest.skip("the config accepts model.device: cuda for the roles: the check runs on a GPU")


def test_no_gpu_is_told_apart_from_a_gpu_host_with_something_missing(monkeypatch):
    import gpu_check_devices

    from pdkv.gpu import guard

    class FakeDriverNoDevice:  # fault injection: cuda-python's driver module (cuInit fails without devices)
        def __init__(self, count, driver_version=13000):
            self.count, self.driver_version = count, driver_version

        def cuDriverGetVersion(self):
            return (0, self.driver_version)

        def cuInit(self, flags):
            return (0,) if self.count else (guard.CUDA_ERROR_NO_DEVICE,)

        def cuDeviceGetCount(self):
            return (0, self.count)

        def cuGetErrorName(self, err):
            return (0, b"CUDA_ERROR_NO_DEVICE")

    monkeypatch.setattr(gpu_check_devices.ctypes, "CDLL", lambda name: object())  # "libcuda loads"
    monkeypatch.setattr(guard, "_load_libcuda", lambda: None)
    monkeypatch.setattr(guard, "bindings_version", lambda drv=None: "13.4.4")
    monkeypatch.setattr(guard, "_load_bindings", lambda: FakeDriverNoDevice(None))  # cuInit: NO_DEVICE
    assert "no CUDA device" in gpu_check_devices.no_gpu_reason()  # nothing to check: exit 0
    monkeypatch.setattr(guard, "_load_bindings", lambda: FakeDriverNoDevice(1, driver_version=12080))
    assert gpu_check_devices.no_gpu_reason() is None  # a GPU with the wrong bindings: the guard FAILs


def test_a_check_needing_an_extension_that_is_not_built_is_skipped_with_the_builds_reason(monkeypatch):
    import gpu_check_build

    # fault injection: an extension name nothing builds, so it never imports
    monkeypatch.setattr(gpu_check_build, "EXTENSIONS", ("pdkv._messenger", "pdkv._not_built"))
    ran = []
    cant = "cannot build pdkv's extensions with python 3.x: no C compiler: CC='/x/cc' is not on PATH"
    needs_built = gpu_check.Check("uses-messenger", lambda: ran.append("m") or "ok", frozenset({"pdkv._messenger"}))
    needs_unbuilt = gpu_check.Check("uses-other", lambda: ran.append("o") or "ok", frozenset({"pdkv._not_built"}))
    results = gpu_check.run_checks([gpu_check.Check("build", lambda: (_ for _ in ()).throw(gpu_check.Skip(cant))),
                                    needs_built, needs_unbuilt], budget=1e9)
    assert [r.status for r in results] == ["SKIP", "PASS", "SKIP"] and ran == ["m"]  # importable: it runs
    assert results[2].detail == f"needs pdkv._not_built, which is not built for this Python: {cant}"
    results = gpu_check.run_checks([gpu_check.Check("build", _boom), needs_unbuilt], budget=1e9)
    assert results[1].detail.endswith("not built for this Python: the build step failed (above)")
    results = gpu_check.run_checks([needs_unbuilt], budget=1e9)  # e.g. a --child run: nothing built it
    assert results[0].status == "SKIP" and results[0].detail.endswith("the build step did not run")


def test_the_toolchain_check_names_a_missing_compiler_and_missing_python_headers(monkeypatch, tmp_path):
    import sysconfig

    import gpu_check_build

    assert gpu_check_build.toolchain_problem() is None  # this machine builds the extensions
    monkeypatch.setenv("CC", "/nonexistent/cc")
    real = sysconfig.get_paths
    monkeypatch.setattr(sysconfig, "get_paths", lambda *a, **k: {**real(*a, **k), "include": str(tmp_path)})
    problem = gpu_check_build.toolchain_problem()
    assert f"no Python headers: {tmp_path / 'Python.h'} does not exist" in problem, problem
    assert "no C compiler: CC='/nonexistent/cc' is not on PATH" in problem, problem
    with pytest.raises(gpu_check.Skip, match="cannot build pdkv's extensions with python .*no C compiler"):
        gpu_check_build.check_build()


def test_an_older_torch_is_named_with_what_it_lacks_and_the_version_needed():
    import types

    import gpu_check_apis as apis

    assert apis.missing(torch, "torch", torch.__version__, apis.TORCH) == []  # the torch here has them all

    def graph(cuda_graph, pool=None, stream=None):  # an older torch.cuda.graph: no capture_error_mode
        pass

    # fault injection: a stand-in for an old torch, the real one with two APIs taken away
    old = types.SimpleNamespace(**{k: getattr(torch, k) for k in ("as_tensor", "empty", "frombuffer")})
    old.cuda = types.SimpleNamespace(**{k: getattr(torch.cuda, k) for k in dir(torch.cuda) if not k.startswith("__")})
    old.cuda.graph = graph
    old.nn = types.SimpleNamespace(functional=types.SimpleNamespace(
        scaled_dot_product_attention=torch.nn.functional.scaled_dot_product_attention))
    got = apis.missing(old, "torch", "2.3.0", apis.TORCH)
    assert got == ["torch 2.3.0: torch.cuda.graph takes no capture_error_mode= (needs torch >= 2.1; used by "
                   "pdkv/engine/cuda_graphs.py)",
                   "torch 2.3.0 has no torch.nn.functional.rms_norm (needs torch >= 2.4; used by models/layers.py)"]


def test_only_adds_the_build_for_a_check_that_needs_an_extension(tmp_path, capsys):
    if HAVE_GPU:
        pytest.skip("on a GPU machine this would run the checks")
    out = tmp_path / "r.json"
    assert gpu_check.main(["--only", "disagg-gpu", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert [c["name"] for c in report["checks"]] == ["guard", "build", "disagg-gpu"] and report["complete"]
    gpu_check.main(["--only", "counter", "--json", str(out)])
    assert [c["name"] for c in json.loads(out.read_text())["checks"]] == ["guard", "counter"]
