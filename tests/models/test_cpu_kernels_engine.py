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
from models import cpu_kernels
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
            self.n += 1
            return fn(*a)
        return counted


@pytest.mark.parametrize("name", ["llama", "qwen3_moe", "deepseek_v3"])
def test_kernels_on_and_off_give_the_same_tokens(name, folders, monkeypatch):
    from models.attention import cpu_decode

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
