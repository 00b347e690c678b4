"""TP2 on two GPUs: NCCL all-reduces, every rank's KV cache a cuMem allocation that rank 0 imported
(cuMemImportFromShareableHandle). Skipped unless cuda-python and two visible GPUs are present;
NOT run on the development machine (no GPU)."""

from __future__ import annotations

import pytest

from pdkv.engine import SamplingParams
from pdkv.gpu import gpu_unavailable_reason

_REASON = gpu_unavailable_reason(0) or gpu_unavailable_reason(1)
pytestmark = pytest.mark.skipif(_REASON is not None, reason=f"needs two usable GPUs: {_REASON}")


def test_tp2_on_two_gpus_matches_tp1(tp):
    import torch

    d = tp.model_dir("qwen3", 2)
    one = tp.engine(d, 1, device="cuda:0")
    two = tp.engine(d, 2, device="cuda:0")
    try:
        params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
        want = [o.output_token_ids for o in one.generate(tp.PROMPTS, params)]
        assert [o.output_token_ids for o in two.generate(tp.PROMPTS, params)] == want
        regions = two.tp.regions
        assert [r.device for r in regions] == ["cuda:0", "cuda:1"]
        # Rank 1's cache, read in rank 0 through the imported mapping, is not empty.
        assert any(regions[1].cache.layer(i).abs().sum().item() > 0 for i in range(two.kv.num_layers))
        assert regions[0].address == two.kv.data_ptr(0)
        torch.cuda.synchronize()
    finally:
        two.close()
