"""Bad input gets one clear line (exit status 2) before anything is launched: an unknown trace
format, a window that selects nothing, prompts that cannot fit the model even after scaling
(which ones, and how to fix it), an endpoint that does not answer, a malformed flag."""
from __future__ import annotations

import re
import socket

from _abrun import AZURE, MOONCAKE, run_ab


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_unknown_trace_format(tmp_path, tiny_model_dir):
    bad = tmp_path / "trace.txt"
    bad.write_text("time,prompt,answer\n1,2,3\n")
    rc, err = run_ab(["--trace", str(bad), "--model", str(tiny_model_dir), "--out", str(tmp_path)])
    assert rc == 2
    assert "unknown trace format" in err and "Mooncake JSONL" in err and "Azure 2023 CSV" in err
    assert str(bad) in err
    rc, err = run_ab(["--trace", "synth:huge", "--model", str(tiny_model_dir), "--out", str(tmp_path)])
    assert rc == 2 and "unknown preset" in err and "mixed" in err


def test_window_that_selects_nothing(tmp_path, tiny_model_dir):
    rc, err = run_ab(["--trace", str(MOONCAKE), "--window", "5000:5100", "--model", str(tiny_model_dir),
                      "--out", str(tmp_path)])
    assert rc == 2
    assert "window 5000:5100 s selects no request" in err and "span 0 to" in err
    rc, err = run_ab(["--trace", str(MOONCAKE), "--window", "9:3", "--model", str(tiny_model_dir)])
    assert rc == 2 and "START:END" in err


def test_prompts_that_do_not_fit_even_after_scaling(tmp_path, tiny_model_dir):
    rc, err = run_ab(["--trace", str(MOONCAKE), "--length-scale", "0.5", "--model", str(tiny_model_dir),
                      "--out", str(tmp_path)])
    assert rc == 2
    assert "do not fit the model's context of 2048 tokens" in err
    assert re.search(r"34 of 40 requests .*\(row \d+: \d+ prompt \+ \d+ output tokens; ", err)  # says which
    assert "--length-scale" in err and "--clip" in err  # and how to fix it
    # the suggested scale really fits, and --clip fits at any scale (checked without launching)
    from pdkv.bench.ab.traces import read_trace
    from pdkv.bench.ab.workload import Scaling, build_workload

    suggested = float(err.split("use --length-scale ")[1].split()[0])
    wl = build_workload(read_trace(MOONCAKE), Scaling(length_scale=suggested, max_model_len=2048))
    assert max(i.prompt_len + i.max_tokens for i in wl.items) <= 2048
    wl = build_workload(read_trace(MOONCAKE), Scaling(length_scale=0.5, max_model_len=2048, clip=True))
    assert wl.num_clipped > 0 and all(i.prompt_len + i.max_tokens <= 2048 for i in wl.items)


def test_unreachable_endpoint(tmp_path, tiny_model_dir):
    url = f"http://127.0.0.1:{_closed_port()}"
    rc, err = run_ab(["--trace", str(AZURE), "--length-scale", "0.1", "--model", str(tiny_model_dir),
                      "--archs", "", "--endpoint", f"vllm={url}", "--out", str(tmp_path)])
    assert rc == 2
    assert f"--endpoint vllm={url} is not reachable" in err and "refused" in err.lower()


def test_malformed_flags_and_configs(tmp_path, tiny_model_dir):
    base = ["--trace", str(AZURE), "--length-scale", "0.1", "--model", str(tiny_model_dir), "--out", str(tmp_path)]
    rc, err = run_ab(base + ["--fault", "router@3"])
    assert rc == 2 and "--fault must be ROLE@SECONDS" in err
    rc, err = run_ab(base + ["--pd", "2-1"])
    assert rc == 2 and "--pd must be P:D" in err
    rc, err = run_ab(base + ["--set", "parallel.cpus=zero"])
    assert rc == 2 and "--set parallel.cpus=zero: parallel.cpus must be a CPU list" in err
    rc, err = run_ab(["--render", str(tmp_path / "nowhere")])
    assert rc == 2 and "cannot read report.json" in err
    rc, err = run_ab(base + ["--set", "server.port=8000"])
    assert rc == 2 and "server.port is set by the harness" in err
    bad = tmp_path / "mine.yaml"
    bad.write_text("kind: disagregated\n")
    rc, err = run_ab(base + ["--archs", "", "--arch", f"mine={bad}"])
    assert rc == 2 and f"{bad}: kind must be one of colocated, disagg" in err


def test_an_already_running_endpoint_is_replayed_with_client_side_metrics(tmp_path, tiny_model_dir):
    """--endpoint NAME=URL: any OpenAI-compatible server (here a pdkv colocated server in this
    process); the bodies carry the endpoint's own model name. An architecture that does not start
    (pinned to a CPU that does not exist) is reported with its log, and costs the others nothing."""
    import json

    from pdkv.config import config_from_dict
    from pdkv.engine import LLMEngine
    from pdkv.server.runner import ServerThread

    cfg = config_from_dict({"model": {"path": str(tiny_model_dir)}, "server": {"port": 0},
                            "kv_cache": {"num_pages": 256}})
    with ServerThread(cfg, LLMEngine.from_config(cfg, num_threads=1)) as srv:
        broken = tmp_path / "broken.yaml"
        broken.write_text("kind: colocated\nparallel: {cpus: '4095'}\n")
        rc, err = run_ab(["--trace", str(AZURE), "--first", "6", "--length-scale", "0.01", "--output-scale", "0.3",
                          "--rate", "6", "--model", str(tiny_model_dir), "--archs", "", "--arch", f"broken={broken}",
                          "--endpoint", f"mine={srv.url}", "--out", str(tmp_path), "--no-plots"])
    assert rc == 1 and "broken did not start: node broken-colocated-0 exited with status 1" in err, err
    assert "CPUs [4095] that this process may not use" in err
    rep = json.loads((tmp_path / "report.json").read_text())
    (run,) = rep["runs"]
    assert "launch_error" in rep["archs"][0] and rep["archs"][1]["kind"] == "endpoint" and rep["model"]["served_name"] == tiny_model_dir.name
    assert [r["status"] for r in run["requests"]] == ["ok"] * 6
    assert all(r["num_tokens"] == r["max_tokens"] for r in run["requests"])
    assert "server" not in run and run["summary"]["all"]["num_ok"] == 6
