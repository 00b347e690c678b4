"""gpu_check's disaggregated step: a prefill and a decode process sharing one GPU, over tcp, with
the KV on the GPU staged through pinned host memory (pdkv/disagg/staged.py), must answer the
same greedy tokens as a colocated engine on that GPU.

``run_disagg("cuda")`` is the GPU check; ``run_disagg("cpu")`` runs the very same two-process
flow with host KV through the CPU copy engine (``messenger.staging: cpu``), so everything but
the CUDA copies is exercised on any machine (tests/gpu/test_gpu_check.py does).

The cluster is ``pdkv up`` (pdkv/disagg/launcher.py) from a cluster file written here: a tiny
random llama (pdkv.tiny_model), 4-token pages, chunked prefill, layer-wise writes. Beyond the
tokens: both nodes' /metrics agree on the KV bytes moved, and each node's log says its KV went
through the staging ring with the expected copy engine.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PROMPTS = [list(range(3, 3 + n)) for n in (2, 5, 13, 21, 40)] + [[7] * 9, list(range(100, 131))]
MAX_TOKENS = 6


def _free_port() -> int:
    from pdkv.ports import free_port

    return free_port("127.0.0.1")


def _colocated(model_dir: Path, device: str) -> list[list[int]]:
    from pdkv.config import config_from_dict
    from pdkv.engine import LLMEngine, SamplingParams

    cfg = config_from_dict({"model": {"path": str(model_dir), "device": device},
                            "kv_cache": {"page_size": 4, "num_pages": 256},
                            "scheduler": {"max_num_batched_tokens": 64, "chunk_size": 16, "max_num_seqs": 8}})
    eng = LLMEngine.from_config(cfg)
    outs = eng.generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True))
    return [o.output_token_ids for o in outs]


def _get(url: str, timeout: float = 5.0) -> bytes:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.read()


def _metric(url: str, name: str) -> float:
    lines = [x for x in _get(url + "/metrics").decode().splitlines() if x.startswith(name)]
    return sum(float(x.split()[-1]) for x in lines)


def _wait_healthy(url: str, proc, log: Path, timeout: float) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise AssertionError(f"pdkv up exited {proc.returncode}: {log.read_text()[-3000:]}")
        try:
            if json.loads(_get(url + "/health", 2.0)).get("status") == "ok":
                return
        except (OSError, ValueError):
            pass
        time.sleep(0.5)
    raise AssertionError(f"the cluster was not healthy within {timeout:.0f} s: {log.read_text()[-3000:]}")


def run_disagg(device: str = "cuda", timeout: float = 240.0) -> tuple[str, dict]:
    import yaml

    from pdkv.tiny_model import make_tiny_model

    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="pdkv-gpu-disagg-") as tmp:
        tmp = Path(tmp)
        model_dir = make_tiny_model(tmp / "tiny", arch="llama", seed=0)
        want = _colocated(model_dir, device)
        api, metrics_port = _free_port(), _free_port()
        cluster = {
            "model": {"path": str(model_dir), "dtype": "float32", "device": device},
            "kv_cache": {"page_size": 4, "num_pages": 256},
            "scheduler": {"max_num_batched_tokens": 64, "chunk_size": 16, "max_num_seqs": 8},
            "server": {"host": "127.0.0.1", "port": api},
            "messenger": {"transport": "tcp", "staging": "auto" if device.startswith("cuda") else "cpu",
                          "staging_mib": 4.0, "staging_slot_kib": 64, "layerwise": True},
            "prefill": {"server": {"port": metrics_port}},
            "decode": {"disagg": {"local_prefill_max_tokens": 0}},  # every prompt crosses the pair
        }
        path = tmp / "cluster.yaml"
        path.write_text(yaml.safe_dump(cluster, sort_keys=False))
        log = tmp / "up.log"
        env = dict(os.environ, PYTHONPATH=str(REPO))
        with open(log, "w") as out:
            proc = subprocess.Popen([sys.executable, "-m", "pdkv", "up", "-c", str(path), "--log-level", "info"],
                                    cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        url, purl = f"http://127.0.0.1:{api}", f"http://127.0.0.1:{metrics_port}"
        try:
            _wait_healthy(url, proc, log, timeout)
            name = json.loads(_get(url + "/v1/models"))["data"][0]["id"]
            got = []
            for p in PROMPTS:
                body = json.dumps({"model": name, "prompt": p, "max_tokens": MAX_TOKENS, "temperature": 0,
                                   "ignore_eos": True, "return_token_ids": True}).encode()
                req = urllib.request.Request(url + "/v1/completions", body, {"Content-Type": "application/json"})
                try:
                    got.append(json.loads(_get_req(req))["choices"][0]["token_ids"])
                except urllib.error.HTTPError as e:
                    raise AssertionError(f"{len(p)}-token prompt: HTTP {e.code}: {e.read()[:500]!r}") from None
            assert got == want, f"disaggregated tokens differ from colocated on {device}: {got} != {want}"
            # the decode node answers once the KV landed; the prefill node counts a job's bytes
            # when it hears its writes completed, which can come a moment after: wait for it
            end = time.monotonic() + 15
            while True:
                sent = _metric(purl, "pdkv_kv_transfer_bytes_total")
                landed = _metric(url, "pdkv_kv_transfer_bytes_total")
                if sent == landed > 0 or time.monotonic() > end:
                    break
                time.sleep(0.2)
            assert sent == landed > 0, f"KV bytes: prefill sent {sent}, decode counted {landed}"
        finally:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)
        text = log.read_text()
        engine = "cuda-copy" if device.startswith("cuda") else "cpu-copy"
        for what in (f"prefill: KV staged through", f"decode: KV lands in"):
            lines = [x for x in text.splitlines() if what in x]
            assert lines and all(engine in x for x in lines), f"no '{what} ... ({engine})' in the nodes' log"
    seconds = time.monotonic() - t0
    return (f"{len(PROMPTS)} prompts, prefill + decode processes on {device}, tcp + staging ({engine}): "
            f"tokens equal colocated, {int(sent)} KV bytes moved"), {"seconds": seconds, "kv_bytes": sent,
                                                                    "tokens": got, "device": device}


def _get_req(req, timeout: float = 60.0) -> bytes:
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return r.read()
