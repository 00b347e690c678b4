"""gpu_check's ``weights-ipc``: model.share_weights on a GPU (CUDA IPC, pdkv/gpu/weights_ipc.py).

An owner process loads a random bf16 llama (~0.4 GB) on the GPU with ``model.share_weights: on``
and serves it; a second process with the same config attaches: the GPU memory in use grows by
less than 10% of the weight bytes when it attaches (``cudaMemGetInfo`` before / after, the KV
cache excluded by sizing it first), its greedy tokens equal a private engine's on the same GPU;
then the owner is killed with SIGKILL and the attached process answers the same tokens again
(its imported handle keeps the memory). ``python tools/gpu_check_weights.py`` runs it alone.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PROMPTS = [list(range(3, 40)), [7] * 9, list(range(100, 131))]


def _engine(path: str, device: str, share: str):
    from pdkv.config import load_config
    from pdkv.engine import LLMEngine

    cfg = load_config(overrides=[f"model.path={path}", f"model.device={device}", "model.dtype=bfloat16",
                                 f"model.share_weights={share}", "kv_cache.page_size=16", "kv_cache.num_pages=64"])
    return LLMEngine.from_config(cfg)


def _tokens(eng) -> list:
    from pdkv.engine import SamplingParams

    outs = eng.generate(PROMPTS, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    return [o.output_token_ids for o in outs]


def _worker(role: str, path: str, device: str) -> None:
    import torch

    def say(**kw):
        print(json.dumps(kw), flush=True)

    torch.cuda.init()
    torch.empty(1, device=device)  # the context before measuring
    free0 = torch.cuda.mem_get_info(torch.device(device))[0]
    eng = _engine(path, device, "on")
    free1 = torch.cuda.mem_get_info(torch.device(device))[0]
    shared = getattr(eng.loaded, "shared", None)
    say(role=role, grew=free0 - free1, kind=type(shared).__name__, tokens=_tokens(eng))
    if role == "owner":
        sys.stdin.readline()  # held until killed
    else:
        sys.stdin.readline()  # the owner is dead now
        say(role=role, tokens=_tokens(eng))


def _child(role: str, path: str, device: str):
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    return subprocess.Popen([sys.executable, __file__, "--worker", role, path, device], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, env=env)


def _line(p) -> dict:
    line = p.stdout.readline()
    if not line:
        raise RuntimeError(f"worker exited (rc {p.wait(30)})")
    return json.loads(line)


def run_weights_ipc(device: str = "cuda:0") -> tuple[str, dict]:
    from pdkv.tiny_model import make_tiny_model

    with tempfile.TemporaryDirectory(prefix="pdkv-wipc-") as tmp:
        path = str(make_tiny_model(Path(tmp) / "m", hidden_size=1024, num_layers=12, num_heads=16, num_kv_heads=4,
                                   intermediate_size=4096, vocab_size=32000, seed=0))
        want = _tokens(_engine(path, device, "off"))
        owner = _child("owner", path, device)
        attach = None
        try:
            o = _line(owner)
            attach = _child("attach", path, device)
            a = _line(attach)
            weight_bytes = o["grew"]
            owner.send_signal(signal.SIGKILL)
            owner.wait(30)
            attach.stdin.write("\n")
            attach.stdin.flush()
            after = _line(attach)
        finally:
            for p in (owner, attach):
                if p is not None and p.poll() is None:
                    p.kill()
    ok = o["tokens"] == want and a["tokens"] == want and after["tokens"] == want
    ratio = a["grew"] / max(weight_bytes, 1)
    data = {"owner_grew": o["grew"], "attach_grew": a["grew"], "ratio": ratio, "tokens_equal": ok,
            "attach_kind": a["kind"]}
    if not ok or a["kind"] != "CuMemWeights":
        raise RuntimeError(f"weights-ipc: tokens equal {ok}, attached memory {a['kind']}: {data}")
    if ratio >= 0.10:
        raise RuntimeError(f"weights-ipc: the attaching process's GPU memory grew {ratio:.1%} of the owner's")
    return (f"attached on {device}: GPU memory +{a['grew'] / 2**20:.0f} MiB vs the owner's "
            f"+{o['grew'] / 2**20:.0f} MiB ({ratio:.1%}); tokens equal private, and again after the owner's "
            "SIGKILL"), data


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        _worker(sys.argv[2], sys.argv[3], sys.argv[4])
    else:
        print(run_weights_ipc(os.environ.get("PDKV_GPU_CHECK_DEVICE", "cuda:0")))
