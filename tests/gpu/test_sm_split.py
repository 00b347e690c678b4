"""parallel.gpu_sm_percent on the CPU: the config's checks, which mechanism a split uses (MPS when
its daemon runs, else a green context, else a clear error), the SM rounding, and the MPS
variable set before CUDA; on a machine without a GPU nothing imports CUDA."""
from __future__ import annotations

import subprocess
import sys

import pytest

from pdkv.config import ConfigError, config_from_dict
from pdkv.gpu import sm_split
from pdkv.gpu.sm_split import MPS_ENV, SMPlan, SMSplitError, green_sms, plan


def test_whole_gpu_needs_no_mechanism():
    for p in (0, 100):
        assert plan(p, mps=False, green=False) == SMPlan("none", p)


def test_mps_first_then_green_else_an_error_naming_both():
    assert plan(30, mps=True, green=True, environ={}) == SMPlan("mps", 30)
    assert plan(30, mps=False, green=True, total_sms=132, major=9) == SMPlan("green", 30, 32)
    with pytest.raises(SMSplitError, match="needs MPS .* or CUDA green contexts"):
        plan(30, mps=False, green=False)
    with pytest.raises(SMSplitError, match="0..100"):
        plan(101, mps=True, green=True)


def test_an_mps_percentage_already_in_the_environment_must_agree():
    assert plan(40, mps=True, green=False, environ={MPS_ENV: "40"}).mechanism == "mps"
    with pytest.raises(SMSplitError, match=f"{MPS_ENV}=70 is set"):
        plan(40, mps=True, green=False, environ={MPS_ENV: "70"})


@pytest.mark.parametrize("total,percent,major,want", [(132, 30, 9, 32), (132, 70, 9, 88), (132, 1, 9, 8),
                                                       (108, 50, 8, 54), (108, 33, 8, 34), (20, 1, 7, 2)])
def test_green_partitions_round_down_to_the_drivers_granule(total, percent, major, want):
    assert green_sms(total, percent, major) == want


def test_mps_is_detected_by_its_control_pipe(tmp_path):
    assert not sm_split.mps_running({"CUDA_MPS_PIPE_DIRECTORY": str(tmp_path)})
    (tmp_path / "control").touch()
    assert sm_split.mps_running({"CUDA_MPS_PIPE_DIRECTORY": str(tmp_path)})


def test_apply_sets_the_mps_variable_and_green_waits_for_the_engine_thread(monkeypatch):
    env = {}
    monkeypatch.setattr(sm_split, "_active", None)
    sm_split.apply(SMPlan("mps", 25), "cuda:1", environ=env)
    assert env == {MPS_ENV: "25"} and sm_split.active() == SMPlan("mps", 25)
    assert sm_split.enter_current_thread() is None  # MPS bounds the process; nothing per thread


def test_config_checks_the_percentage_and_the_device():
    assert config_from_dict({"model": {"device": "cuda:0"}, "parallel": {"gpu_sm_percent": 30}})
    with pytest.raises(ConfigError, match="parallel.gpu_sm_percent must be a share of the GPU's SMs in 0..100"):
        config_from_dict({"model": {"device": "cuda:0"}, "parallel": {"gpu_sm_percent": 130}})
    with pytest.raises(ConfigError, match="parallel.gpu_sm_percent must be 0 with model.device cpu"):
        config_from_dict({"parallel": {"gpu_sm_percent": 30}})


def test_deciding_imports_no_torch():
    """The module (which the engine loop imports) touches torch only for a green context."""
    code = ("import sys; from pdkv.gpu import sm_split; "
            "assert sm_split.enter_current_thread() is None; "
            "assert sm_split.plan(30, mps=True, green=False, environ={}).mechanism == 'mps'; "
            "assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_the_gpu_check_skips_naming_what_is_missing(monkeypatch):
    """tools/gpu_check.py's sm-split on a machine that can make no split: SKIP, not FAIL."""
    import os
    from pathlib import Path

    tools = str(Path(__file__).resolve().parents[2] / "tools")
    monkeypatch.syspath_prepend(tools)
    import gpu_check_sm_split
    from gpu_check_models import SkipCheck

    monkeypatch.setenv("CUDA_MPS_PIPE_DIRECTORY", "/nonexistent-mps")
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is here: the check runs for real")
    with pytest.raises(SkipCheck, match="no CUDA device"):
        gpu_check_sm_split.run_sm_split("cuda")
    assert os.environ.get(MPS_ENV) is None
