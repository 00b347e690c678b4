"""The command line (``python -m pdkv``) and the embedded default model, run as real processes."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import yaml

from pdkv.cli import main
from pdkv.default_model import default_model_dir, ensure_default_model

ROOT = Path(__file__).resolve().parents[2]


def run_pdkv(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pdkv", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout)


def test_config_command_prints_resolved_yaml(capsys):
    assert main(["config", "-c", "configs/colocated.yaml", "--set", "server.port=8123",
                 "--set", "kv_cache.layout=NHD"]) == 0
    out = capsys.readouterr().out
    data = yaml.safe_load(out)
    assert data["server"]["port"] == 8123 and data["kv_cache"]["layout"] == "NHD"
    assert data["role"] == "colocated"


def test_python_dash_m_reports_config_errors_with_status_2():
    r = run_pdkv("serve", "-c", "configs/colocated.yaml", "--set", "kv_cache.layout=HDN")
    assert r.returncode == 2
    assert "--set kv_cache.layout=HDN: kv_cache.layout must be one of HND, NHD, got 'HDN'" in r.stderr
    r = run_pdkv("serve", "-c", "configs/missing.yaml")
    assert r.returncode == 2 and "configs/missing.yaml: cannot read config file" in r.stderr


def test_decode_role_without_prefill_peers_is_refused_clearly(capsys):
    assert main(["serve", "-c", "configs/colocated.yaml", "--set", "role=decode"]) == 2
    assert "configs/colocated.yaml: messenger.prefill_peers must be at least one host:port for role decode" \
        in capsys.readouterr().err


def test_gpu_kv_for_a_role_on_a_host_without_cuda_is_refused_before_loading(capsys):
    import pytest

    from pdkv.gpu import gpu_unavailable_reason

    if gpu_unavailable_reason() is None:
        pytest.skip("this host has a GPU")
    assert main(["serve", "-c", "configs/prefill.yaml", "--set", "model.device=cuda"]) == 2
    err = capsys.readouterr().err
    assert "configs/prefill.yaml: role prefill with model.device cuda: CUDA is not available here" in err, err
    assert "loading" not in err  # refused before any weight was read


def test_unknown_command_is_an_argparse_error():
    r = run_pdkv("frobnicate")
    assert r.returncode == 2 and "invalid choice: 'frobnicate'" in r.stderr


def test_default_model_command_prints_the_shipped_folder(tmp_path):
    # The default model ships inside the package: nothing is built, whatever the cache says.
    r = run_pdkv("default-model")
    assert r.returncode == 0, r.stderr
    target = default_model_dir()
    assert r.stdout.strip() == str(target) == ensure_default_model(tmp_path)
    assert target == ROOT / "pdkv" / "data" / "pdkv-stdlib-coder"
    assert {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
            "tokenizer_config.json", "README.md", "heldout.txt"} <= {p.name for p in target.iterdir()}


def test_env_is_typed_and_checked():
    import pytest

    from pdkv.env import read_env

    env = read_env({"PDKV_CACHE_DIR": "/tmp/x", "PDKV_LOG_LEVEL": "DEBUG", "PDKV_NO_VERBS": "1"})
    assert str(env.cache_dir) == "/tmp/x" and env.log_level == "debug" and env.no_verbs
    env = read_env({"XDG_CACHE_HOME": "/c"})
    assert str(env.cache_dir) == "/c/pdkv" and env.log_level == "info" and not env.no_verbs
    with pytest.raises(ValueError, match="PDKV_LOG_LEVEL must be debug, info, warning or error, got 'loud'"):
        read_env({"PDKV_LOG_LEVEL": "loud"})
