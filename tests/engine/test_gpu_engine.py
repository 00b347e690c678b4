"""The engine on a GPU: the torch backend on CUDA gives the CPU's tokens, and FlashInfer (when
installed) gives the torch backend's tokens. Skipped, with the reason, where there is no GPU."""

from __future__ import annotations

import pytest
import torch

from pdkv.engine import SamplingParams

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device (torch.cuda.is_available() is False)")

GREEDY = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
PROMPTS = [list(range(3, 3 + n)) for n in (1, 15, 33, 70)]


def test_torch_backend_on_cuda_matches_cpu(make_engine):
    cpu = [o.output_token_ids for o in make_engine(num_pages=64).generate(PROMPTS, GREEDY)]
    for layout in ("HND", "NHD"):
        gpu = make_engine(num_pages=64, layout=layout, device="cuda")
        assert gpu.kv.layer(0).is_cuda
        assert [o.output_token_ids for o in gpu.generate(PROMPTS, GREEDY)] == cpu


@pytest.mark.parametrize("layout", ["HND", "NHD"])
def test_flashinfer_matches_torch_backend(make_engine, tmp_path, layout):
    pytest.importorskip("flashinfer")
    from pdkv.tiny_model import make_tiny_model

    # FlashInfer wants half precision and a head_dim it has kernels for (64 here).
    folder = make_tiny_model(tmp_path / "m", hidden_size=256, num_heads=4, num_kv_heads=2, dtype="bfloat16")
    kw = dict(path=folder, num_pages=64, layout=layout, device="cuda", dtype="bfloat16")
    ref = make_engine(**kw).generate(PROMPTS, GREEDY)
    fi = make_engine(**kw, attention_backend="flashinfer", chunk=16, budget=32).generate(PROMPTS, GREEDY)
    # bf16 kernels round differently: most tokens, not all, must agree.
    same = sum(a == b for r, f in zip(ref, fi) for a, b in zip(r.output_token_ids, f.output_token_ids))
    assert same >= 0.8 * sum(len(r.output_token_ids) for r in ref)
