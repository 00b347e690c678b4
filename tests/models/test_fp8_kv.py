"""An FP8 KV cache (kv_cache.dtype fp8_e4m3) on one node: K/V (and MLA's latent) stored as e4m3,
half a bf16 cache's bytes; greedy parity with the float32 cache; prefix caching and ngram
speculation give the tokens of the same FP8-KV run without them; the checkpoint's k_scale /
v_scale (or kv_cache.fp8_scale) divide what is stored.

Tolerance against the float32 cache: e4m3 keeps 3 mantissa bits, so a stored K/V value is off by
at most 2^-4 of itself (RMS ~2^-4 / sqrt(3) = 3.6% for uniform rounding error). Attention mixes
many such values (errors average out in q . k and in the weighted sum of V), and attention is one
of two summands of each layer's residual update, so the logits move by well under that: the
first step's logits within 5% relative (the tiny llama measures ~1%) and its 16 greedy tokens
identical. The MoE models' random weights amplify it more (see the test).
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from pdkv.config import KVCacheConfig, ModelConfig, SchedulerConfig, SpeculativeConfig
from pdkv.engine import LLMEngine, SamplingParams
from _hf import prompts, run_greedy

FP8 = torch.float8_e4m3fn


def _engine(folder, kv_dtype="auto", dtype="float32", prefix=True, spec=None, scale=None, pages=96):
    return LLMEngine(ModelConfig(path=str(folder), dtype=dtype),
                     KVCacheConfig(page_size=16, num_pages=pages, dtype=kv_dtype, prefix_caching=prefix,
                                   fp8_scale=scale),
                     SchedulerConfig(max_num_batched_tokens=512, chunk_size=64), speculative=spec)


def test_cache_is_fp8_and_half_the_bytes_of_bf16(tiny_model_dir):
    fp8, bf16 = _engine(tiny_model_dir, "fp8_e4m3", "bfloat16"), _engine(tiny_model_dir, "auto", "bfloat16")
    assert fp8.kv.layer(0).dtype == FP8 and bf16.kv.layer(0).dtype == torch.bfloat16
    assert 2 * fp8.kv.page_nbytes == bf16.kv.page_nbytes
    toks, _ = run_greedy(fp8, prompts()[:1], 4)
    assert fp8.kv.layer(0).float().abs().sum() > 0  # really written
    assert len(toks[0]) == 4


def test_greedy_parity_with_a_float32_cache(tiny_model_dir):
    ps = prompts()
    ref, a = run_greedy(_engine(tiny_model_dir), ps, 16)
    got, b = run_greedy(_engine(tiny_model_dir, "fp8_e4m3"), ps, 16)
    assert got == ref
    _, a = run_greedy(_engine(tiny_model_dir), ps, 1)
    _, b = run_greedy(_engine(tiny_model_dir, "fp8_e4m3"), ps, 1)
    assert all(float((x - y).norm() / x.norm()) < 0.05 for x, y in zip(a, b))


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3"])
def test_fp8_cache_is_attention_over_e4m3_rounded_kv(family, fp8_models, monkeypatch):
    """The MoE families' random weights amplify the rounding (first-step logits move 4-32%), so
    instead: the FP8 cache's logits equal those of a float32 cache whose writes round K/V (the
    latent) through e4m3 first (the reference, a patched write): nothing but that rounding."""
    from pdkv.models.attention import fp8_kv
    from pdkv.models.attention.torch_backend import TorchAttentionBackend

    _, _, folder = fp8_models[family]
    ps = prompts()
    _, got = run_greedy(_engine(folder, "fp8_e4m3"), ps, 3)
    real = TorchAttentionBackend._write

    def rounded(self, cache, k, v, meta, hnd):
        k = fp8_kv.quantize(k, 1.0).float()
        v = None if v is None else fp8_kv.quantize(v, 1.0).float()
        return real(self, cache, k, v, meta, hnd)
    monkeypatch.setattr(TorchAttentionBackend, "_write", rounded)
    # the torch attention path, as the FP8 cache takes (the CPU kernel writes K/V itself)
    monkeypatch.setattr(TorchAttentionBackend, "use_cpu_kernel", False)
    _, want = run_greedy(_engine(folder), ps, 3)
    for x, y in zip(got, want):
        torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-5)


def _sequential(eng, ps, n):
    out = []
    for p in ps:  # one after another: the later prompts find the earlier ones' pages cached
        out.append(eng.generate([p], SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))[0].output_token_ids)
    return out


@pytest.mark.parametrize("family", ["llama", "deepseek_v3"])
def test_prefix_caching_and_ngram_on_fp8_kv_change_no_token(family, tiny_model_dir, fp8_models):
    folder = tiny_model_dir if family == "llama" else fp8_models[family][2]
    base = prompts(seed=5, lens=(40,))[0]
    ps = [base, base[:35] + [1, 2, 3], base + [9, 9], [4, 5, 6, 7] * 8]
    ref = _sequential(_engine(folder, "fp8_e4m3", prefix=False), ps, 12)
    cached = _engine(folder, "fp8_e4m3")
    assert _sequential(cached, ps, 12) == ref
    assert cached.stats()["prefix_cache_hits"] > 0
    spec = _engine(folder, "fp8_e4m3", prefix=False, spec=SpeculativeConfig(method="ngram", num_tokens=3))
    assert _sequential(spec, ps, 12) == ref
    s = spec.stats()
    assert s["spec_num_draft_tokens"] > 0, s


def test_checkpoint_kv_scales_and_the_configured_scale(tiny_model_dir, tmp_path):
    """k_scale / v_scale tensors of the checkpoint become each layer's scales; the cache holds
    K / scale in e4m3; kv_cache.fp8_scale overrides them."""
    import shutil

    d = tmp_path / "scaled"
    shutil.copytree(tiny_model_dir, d)
    ts = load_file(str(d / "model.safetensors"))
    ts["model.layers.0.self_attn.k_scale"] = torch.tensor(0.5)
    ts["model.layers.1.self_attn.v_scale"] = torch.tensor([0.25])
    save_file(ts, str(d / "model.safetensors"), metadata={"format": "pt"})
    eng = _engine(d, "fp8_e4m3")
    assert eng.kv.kv_scales == [(0.5, 1.0), (1.0, 0.25)]
    one = _engine(tiny_model_dir, "fp8_e4m3")
    p = prompts()[:1]
    a, _ = run_greedy(eng, p, 1)
    b, _ = run_greedy(one, p, 1)
    # the same keys of layer 0, stored at half the scale: twice the stored value (where no clamp)
    ka, kb = eng.kv.layer(0)[:, 0].float(), one.kv.layer(0)[:, 0].float()
    small = kb.abs() < 100
    assert torch.allclose(ka[small], 2 * kb[small], rtol=0.13, atol=0.05)
    assert _engine(d, "fp8_e4m3", scale=2.0).kv.kv_scales == [(2.0, 2.0)] * 2


def test_hello_refuses_a_pair_whose_kv_dtypes_differ():
    from pdkv.control_wire import Hello

    a = Hello(1, "prefill", "fp", "float32", "HND", 16, kv_dtype="float8_e4m3fn")
    b = Hello(2, "decode", "fp", "float32", "HND", 16, kv_dtype="float32")
    assert a.differences(b) == ["kv_dtype: this prefill node has 'float8_e4m3fn', the decode node has 'float32'"]
    assert Hello.from_dict({**b.__dict__, "kv_dtype": "float32"}).differences(b) == []


@pytest.mark.parametrize("kv,message", [({"dtype": "fp8"}, "kv_cache.dtype must be one of auto, fp8_e4m3, got 'fp8'"),
                                        ({"dtype": "fp8_e4m3", "fp8_scale": 0}, "kv_cache.fp8_scale must be a "
                                                                                "positive number or null, got 0")])
def test_bad_kv_cache_settings_name_the_field(kv, message):
    from pdkv.config import ConfigError, config_from_dict, validate

    with pytest.raises(ConfigError, match=message):
        validate(config_from_dict({"kv_cache": kv}))
