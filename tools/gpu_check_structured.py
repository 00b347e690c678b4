"""gpu_check's structured-masks step: structured output's token masks on the device the logits
are on (pdkv/engine/logits.py, ``apply_bitmask_torch``: torch ops, no kernel to build).

``run_structured("cuda")``:
1. parity: a [32, 151936] bitmask (Qwen's vocabulary; random words, every fourth row left out)
   applied to logits on the GPU equals the CPU reference (xgrammar's kernel, else the bits
   unpacked by hand), bit for bit; the bitmask is in pinned memory, as the runner's worker fills
   it, so its copy to the device does not wait;
2. time: ms per apply at B = 1, 8, 32 on that vocabulary (CUDA-synchronised, median of 20);
3. engine: a random model on the GPU decodes 8 JSON-schema-constrained requests (seeded
   sampling): every output parses as JSON, and the tokens with the masks filled on the worker
   during the forward pass equal those with the masks filled after it.
``run_structured("cpu")`` (``gpu_check.py --dry-run``): the same flow on the CPU, through the
same torch ops (the stand-in: what the GPU runs, on CPU tensors).
"""

from __future__ import annotations

import json
import statistics
import tempfile
import time
from pathlib import Path

VOCAB = 151936
SCHEMA = {"type": "object", "properties": {"word": {"type": "string", "maxLength": 12},
                                           "n": {"type": "integer"}}, "required": ["word", "n"]}


def _reference(logits, bitmask, rows):
    import torch

    from pdkv.engine.logits import NEG_INF, allowed_from_bitmask

    out = logits.cpu().clone()
    try:
        from xgrammar import apply_token_bitmask_inplace
    except ImportError:
        idx = torch.tensor(rows)
        out[idx] = out[idx].masked_fill(~allowed_from_bitmask(bitmask[idx], out.shape[1]), NEG_INF)
        return out
    apply_token_bitmask_inplace(out, bitmask, indices=rows)
    return out


def run_structured(device: str = "cuda") -> tuple[str, dict]:
    import torch

    from pdkv.config import KVCacheConfig, ModelConfig, SchedulerConfig
    from pdkv.engine import LLMEngine, SamplingParams
    from pdkv.engine.logits import apply_bitmask_torch, bitmask_width
    from pdkv.engine.structured import GrammarCache
    from pdkv.tiny_model import make_tiny_model

    cuda = device != "cpu"
    sync = (lambda: torch.cuda.synchronize(device)) if cuda else (lambda: None)
    data: dict = {"device": device, "vocab": VOCAB}
    g = torch.Generator().manual_seed(0)
    # 1. parity
    B = 32
    bitmask = torch.randint(-2**31, 2**31 - 1, (B, bitmask_width(VOCAB)), dtype=torch.int32, generator=g)
    bitmask = bitmask.pin_memory() if cuda else bitmask
    rows = [r for r in range(B) if r % 4]
    logits = torch.randn(B, VOCAB, generator=g)
    want = _reference(logits, bitmask, rows)
    got = logits.to(device)
    apply_bitmask_torch(got, bitmask, rows)
    sync()
    assert torch.equal(got.cpu(), want), "the device's masked logits differ from the CPU reference"
    # 2. time
    data["apply_ms"] = {}
    for b in (1, 8, 32):
        x, times = torch.randn(b, VOCAB, device=device), []
        for _ in range(20):
            sync()
            t0 = time.perf_counter()
            apply_bitmask_torch(x, bitmask[:b], list(range(b)))
            sync()
            times.append(time.perf_counter() - t0)
        data["apply_ms"][b] = round(statistics.median(times) * 1e3, 4)
    # 3. engine
    with tempfile.TemporaryDirectory(prefix="pdkv-masks-") as tmp:
        folder = make_tiny_model(Path(tmp) / "m", vocab_size=512)
        outs = {}
        for overlap in (True, False):
            engine = LLMEngine(ModelConfig(path=str(folder), device=device),
                               KVCacheConfig(page_size=16, num_pages=128), SchedulerConfig(max_num_seqs=8))
            engine.runner.overlap_masks = overlap
            c = GrammarCache(engine.tokenizer, engine.vocab_size).get("json", json.dumps(SCHEMA))
            params = [SamplingParams(max_tokens=64, temperature=1.0, seed=s, constraint=c) for s in range(8)]
            res = engine.generate([[3 + s, 5, 7] for s in range(8)], params)
            outs[overlap] = [o.output_token_ids for o in res]
            parsed = 0
            for o in res:
                if o.finish_reason == "stop":
                    obj = json.loads(o.text, strict=False)  # a random vocabulary has control bytes
                    assert isinstance(obj, dict) and set(obj) == {"word", "n"}, o.text
                    parsed += 1
            data[f"parsed_{'overlapped' if overlap else 'after'}"] = parsed
        assert outs[True] == outs[False], "overlapped mask fills changed the tokens"
        assert data["parsed_overlapped"] >= 1, "no constrained request finished within 64 tokens"
    return (f"{device}: masked logits equal the CPU reference at {VOCAB} tokens; apply "
            f"{data['apply_ms'][32]} ms at B=32; {data['parsed_overlapped']}/8 constrained outputs parse, "
            f"overlapped == after"), data
