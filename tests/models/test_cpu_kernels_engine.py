"""The engine with ``model.cpu_kernels`` on (the default) and off: the same greedy tokens and
last-step logits within 1e-5 on a dense model and both MoE families, each prompt alone (every
decode step one row: the kernels' batch-1 path) and all batched (rows 2..5 through the GEMM
kernel, experts with a few rows each); on, the weights stay [out, in] and single-token steps
attend in the kernel; off, the weights are stored [in, out] and the kernels are never called.
Against transformers with the default (kernels on) is every parity test in tests/models and
tests/engine."""

from __future__ import annotations

import pytest
import torch

from _hf import engine, prompts, run_greedy, save_hf_model
from pdkv.models import cpu_kernels
from test_deepseek_v3 import BASE as DS_BASE
from test_deepseek_v3 import CASES as DS_CASES
from test_qwen3_moe import BASE as QWEN_BASE

pytestmark = pytest.mark.skipif(not cpu_kernels.AVAILABLE, reason="pdkv._kernels is not built or the CPU lacks AVX2+FMA")

MODELS = {
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", QWEN_BASE),
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM", {**DS_BASE, **DS_CASES["yarn_groups"]}),
}


@pytest.fixture(scope="module")
def folders(tmp_path_factory, tiny_model_dir):
    out = {"llama": tiny_model_dir}
    for name, (cfg, cls, kw) in MODELS.items():
        d = tmp_path_factory.mktemp(name)
        save_hf_model(cfg, cls, kw, d, tiny_model_dir)
        out[name] = d
    return out


class _Calls:
    """Counts the calls into pdkv._kernels (a spy around the real module)."""

    def __init__(self, real):
        self.real, self.n = real, 0
        self.SUPPORTED = real.SUPPORTED

    def __getattr__(self, name):
        fn = getattr(self.real, name)

        def counted(*a):
            # the sampler's greedy argmax is no model kernel, nor is the runner telling the kernels
            # its thread count: model.cpu_kernels does not switch them
            self.n += name not in ("argmax_rows", "set_threads")
            return fn(*a)
        return counted


@pytest.mark.parametrize("name", ["llama", "qwen3_moe", "deepseek_v3"])
def test_kernels_on_and_off_give_the_same_tokens(name, folders, monkeypatch):
    from pdkv.models.attention import cpu_decode

    spy = _Calls(cpu_kernels._k)
    monkeypatch.setattr(cpu_kernels, "_k", spy)
    monkeypatch.setattr(cpu_decode, "_k", spy)
    ps = prompts(lens=(5, 19, 33))
    results = {}
    for on in (True, False):
        eng = engine(folders[name], cpu_kernels=on)
        lin = eng.loaded.model.model.layers[0].self_attn.o_proj.weight
        assert (lin.stride(1) == 1) == on, lin.stride()  # [out, in] for the kernel, [in, out] for MKL
        before = spy.n
        alone = [run_greedy(eng, [p], 12) for p in ps]
        batched = run_greedy(eng, ps, 12)
        assert (spy.n > before) == on, (spy.n, before)
        assert eng.runner.backend._cpu_kernel == on
        results[on] = ([a[0][0] for a in alone], [a[1][0] for a in alone], batched)
    (tok_on, logit_on, batch_on), (tok_off, logit_off, batch_off) = results[True], results[False]
    assert tok_on == tok_off, name
    assert batch_on[0] == batch_off[0], name
    for a, b in zip(logit_on + batch_on[1], logit_off + batch_off[1]):
        assert ((a - b).norm() / b.norm()).item() < 1e-5, name
    assert all(torch.isfinite(x).all() for x in logit_on)


@pytest.mark.skipif(not cpu_kernels.BF16, reason="this CPU lacks AVX512-BF16")
def test_bfloat16_engine_runs_the_bf16_kernel_within_the_bf16_bound(folders, monkeypatch, one_torch_thread):
    """model.dtype bfloat16 with the kernels on: its GEMMs go through gemm_bf16, and the logits
    stay as close to float32's as torch's own bf16 GEMMs keep them (the 0.05 bound of
    tests/engine/test_runner_hooks.py), alone and batched."""
    from pdkv.config import KVCacheConfig, ModelConfig, SchedulerConfig
    from pdkv.engine import LLMEngine

    calls = []
    real = cpu_kernels._k.gemm_bf16
    monkeypatch.setattr(cpu_kernels._k, "gemm_bf16", lambda *a: (calls.append(a[7]), real(*a))[1])
    ps = prompts(lens=(5, 19, 33))
    logits = {}
    for dtype, on in (("float32", True), ("bfloat16", True), ("bfloat16", False)):
        # one thread for every step (prefill too): the kernels' gate (models/cpu_kernels.py)
        eng = LLMEngine(ModelConfig(path=str(folders["llama"]), dtype=dtype, cpu_kernels=on),
                        KVCacheConfig(page_size=16, num_pages=64), SchedulerConfig(), num_threads=1)
        before = len(calls)
        alone = [run_greedy(eng, [p], 1)[1][0] for p in ps]
        batched = run_greedy(eng, ps, 1)[1]
        assert (len(calls) > before) == (dtype == "bfloat16" and on), (dtype, on)
        logits[dtype, on] = alone + batched
    assert max(calls) > 1  # rows batched through one call
    for kernel, torch_bf16, ref in zip(logits["bfloat16", True], logits["bfloat16", False],
                                       logits["float32", True]):
        assert torch.isfinite(kernel).all()
        assert ((kernel - ref).norm() / ref.norm()).item() < 0.05
        assert ((kernel - torch_bf16).norm() / ref.norm()).item() < 0.05
