"""model.gemm_choice: measure (models/gemm_tuner.py): the tuner times pdkv's kernel against torch
for every shape and row bucket of a real model's linears, and cpu_kernels routes exactly the
(shape, bucket, thread count) it chose to torch and everything else to the kernel."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pdkv.config import Config, ConfigError, ModelConfig
from pdkv.config.validate import validate
from pdkv.models import cpu_kernels, gemm_tuner

pytestmark = pytest.mark.skipif(not cpu_kernels.AVAILABLE, reason="the CPU kernels need x86-64 with AVX2+FMA")


@pytest.fixture(autouse=True)
def _clean_choice():
    before = cpu_kernels.threads(), torch.get_num_threads()
    yield
    cpu_kernels.prefer_torch(set(), 2)
    cpu_kernels.prefer_torch(set(), 3)
    cpu_kernels.set_threads(before[0])
    torch.set_num_threads(before[1])


def test_a_chosen_shape_and_bucket_go_to_torch_at_that_thread_count_only():
    g = torch.Generator().manual_seed(0)
    w, other = torch.randn(96, 1024, generator=g), torch.randn(80, 1024, generator=g)
    x5, x9 = torch.randn(5, 1024, generator=g), torch.randn(9, 1024, generator=g)
    with torch.inference_mode():
        cpu_kernels.set_threads(2)
        kernel5, kernel9, kernel_other = (cpu_kernels.linear(x5, w), cpu_kernels.linear(x9, w),
                                          cpu_kernels.linear(x5, other))
        assert not torch.equal(kernel5, F.linear(x5, w))  # the two differ, so the routing shows
        cpu_kernels.prefer_torch({("linear", 96, 1024, 8)}, threads=2)  # 5..8 rows of w, at 2 threads
        assert torch.equal(cpu_kernels.linear(x5, w), F.linear(x5, w))
        assert torch.equal(cpu_kernels.linear(x9, w), kernel9)  # bucket 16: the kernel
        assert torch.equal(cpu_kernels.linear(x5, other), kernel_other)  # another shape: the kernel
        with cpu_kernels.untuned():
            assert torch.equal(cpu_kernels.linear(x5, w), kernel5)
        assert torch.equal(cpu_kernels.linear(x5, w), F.linear(x5, w))  # back after untuned()
        cpu_kernels.set_threads(3)
        assert torch.equal(cpu_kernels.linear(x5, w), kernel5)  # chosen for 2 threads, not 3
        cpu_kernels.set_threads(2)
        cpu_kernels.prefer_torch(set(), threads=2)  # a new choice for 2 threads replaces the old
        assert torch.equal(cpu_kernels.linear(x5, w), kernel5)


def test_a_gated_mlp_chosen_for_torch_runs_torch_s_gemms():
    g = torch.Generator().manual_seed(1)
    h, inter = 256, 352
    x = torch.randn(3, h, generator=g)
    gate_up, down = torch.randn(2 * inter, h, generator=g) / 16, torch.randn(h, inter, generator=g) / 16
    with torch.inference_mode():
        cpu_kernels.set_threads(2)
        kernel = cpu_kernels.gated_mlp(x, gate_up, down, inter)
        want = cpu_kernels.torch_gated_mlp(x, gate_up, down, inter)
        assert not torch.equal(kernel, want)
        cpu_kernels.prefer_torch({("mlp", inter, h, 4)}, threads=2)
        assert torch.equal(cpu_kernels.gated_mlp(x, gate_up, down, inter), want)
        assert torch.allclose(want, kernel, rtol=1e-4, atol=1e-5)


def test_tune_times_every_shape_and_bucket_of_a_model_and_installs_its_choice(tmp_path):
    from pdkv.models.loader import load_model
    from pdkv.tiny_model import make_tiny_model

    folder = make_tiny_model(tmp_path / "m", hidden_size=128, intermediate_size=256, num_heads=4, num_kv_heads=2)
    model = load_model(folder).model
    torch.set_num_threads(1)
    cpu_kernels.set_threads(1)
    assert gemm_tuner.tune(model, threads=1) == []  # one thread: not measured
    timings = gemm_tuner.tune(model, threads=2, margin=1.0, reps=1)
    assert torch.get_num_threads() == 1 and cpu_kernels.threads() == 1  # put back
    buckets = [b for b in gemm_tuner.BUCKETS if b <= cpu_kernels.KERNEL_ROWS]
    groups = {(t.op, t.n, t.k) for t in timings}
    # q/k/v fused, o_proj, the gated MLP pair, the LM head
    assert groups == {("linear", 4 * 32 + 2 * 2 * 32, 128), ("linear", 128, 128), ("mlp", 256, 128),
                      ("linear", 512, 128)}
    assert sorted((t.op, t.n, t.k, t.rows) for t in timings) == sorted((*grp, b) for grp in groups for b in buckets)
    assert all(t.kernel_s > 0 and t.torch_s > 0 for t in timings)
    chosen = {(t.op, t.n, t.k, t.rows, 2) for t in timings if t.torch_s < t.kernel_s}
    assert {key for key in cpu_kernels._TORCH if key[4] == 2} == chosen


def test_a_bad_gemm_choice_is_named():
    with pytest.raises(ConfigError, match="model.gemm_choice"):
        validate(Config(model=ModelConfig(gemm_choice="fastest")), check_paths=False)


def test_an_engine_with_gemm_choice_measure_tunes_at_load(tiny_model_dir, caplog):
    from pdkv.config import KVCacheConfig, SchedulerConfig
    from pdkv.engine.llm_engine import LLMEngine
    from pdkv.engine.params import SamplingParams

    caplog.set_level("INFO", logger="pdkv.models.gemm_tuner")
    engine = LLMEngine(ModelConfig(path=str(tiny_model_dir), gemm_choice="measure"), KVCacheConfig(num_pages=32),
                       SchedulerConfig(), num_threads=2)
    assert any("GEMM choice at 2 threads" in r.getMessage() for r in caplog.records)
    engine.add_request("r", [1, 2, 3], SamplingParams(max_tokens=4, temperature=0.0))
    while engine.has_unfinished():
        engine.step()
    caplog.clear()
    LLMEngine(ModelConfig(path=str(tiny_model_dir)), KVCacheConfig(num_pages=32), SchedulerConfig(), num_threads=2)
    assert not any("GEMM choice" in r.getMessage() for r in caplog.records)  # the default: no timing
