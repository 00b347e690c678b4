"""`python -m pdkv.bench fp8`: a CPU decode step of a block-quantized FP8 checkpoint against the
same model's bf16 and float32 weights, in the same run.

Model: the seeded ~50M Llama of `pdkv.bench engine` (hidden 512, 8 layers, 8 heads / 2 KV heads,
vocab 32000), its decoder Linear weights quantized to e4m3 with one float32 scale per 128 x 128
block (the DeepSeek-V3/R1 format, models/fp8.py quantize); the float32 and bf16 folders hold the
block-dequantized weights (the same values). Per variant: an engine, a 64-token prompt, then
``--steps`` single-token decode steps at batch 1 and 8 (median ms per step). Also the weight
bytes each variant holds. FP8 layers dequantize into a reused float32 buffer per call
(models/fp8.py), so their step is expected slower than float32 on a CPU: what FP8 buys here is
memory; the speed is the GPU's (tools/gpu_check_fp8.py).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path


def make_variants(root: Path) -> dict[str, tuple[Path, str]]:
    """name → (folder, model.dtype): fp8 (computed in float32), fp32 and bf16 of its values."""
    import torch
    from safetensors.torch import load_file, save_file

    from pdkv.models.fp8 import dequantize, quantize
    from pdkv.tiny_model import make_tiny_model

    src = make_tiny_model(root / "src", hidden_size=512, num_layers=8, num_heads=8, num_kv_heads=2,
                          intermediate_size=1536, vocab_size=32000, max_position_embeddings=4096, seed=0)
    ts = load_file(str(src / "model.safetensors"))
    fp8, deq = {}, {}
    for name, t in ts.items():
        if name.startswith("model.layers.") and name.endswith("_proj.weight"):
            q, s = quantize(t.float())
            fp8[name], fp8[name + "_scale_inv"] = q, s
            deq[name] = dequantize(q, s, (128, 128)).clone()
        else:
            fp8[name] = deq[name] = t
    cfg = json.loads((src / "config.json").read_text())
    out = {}
    for name, tensors, qc in (("fp8", fp8, {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                            "weight_block_size": [128, 128]}), ("dequantized", deq, None)):
        d = root / name
        d.mkdir()
        save_file(tensors, str(d / "model.safetensors"), metadata={"format": "pt"})
        (d / "config.json").write_text(json.dumps({**cfg, **({"quantization_config": qc} if qc else {})}))
        for f in src.iterdir():
            if f.name.startswith("tokenizer"):
                (d / f.name).write_bytes(f.read_bytes())
    del torch
    return {"fp8": (root / "fp8", "float32"), "fp32": (root / "dequantized", "float32"),
            "bf16": (root / "dequantized", "bfloat16")}


def step_ms(folder: Path, dtype: str, batch: int, steps: int) -> tuple[float, int]:
    import torch

    from pdkv.config import KVCacheConfig, ModelConfig, SchedulerConfig
    from pdkv.engine import LLMEngine, SamplingParams

    torch.set_num_threads(1)  # one thread: pdkv's CPU kernels take decode steps there
    eng = LLMEngine(ModelConfig(path=str(folder), dtype=dtype), KVCacheConfig(page_size=16, num_pages=256),
                    SchedulerConfig(max_num_batched_tokens=2048, chunk_size=2048, max_num_seqs=batch),
                    num_threads=1)
    for i in range(batch):
        eng.add_request(str(i), list(range(100 + i, 164 + i)),
                        SamplingParams(max_tokens=steps + 4, temperature=0, ignore_eos=True))
    eng.step()  # the prefills
    eng.step()
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        eng.step()
        times.append(time.perf_counter() - t)
    weights = sum(p.numel() * p.element_size() for p in eng.loaded.model.parameters())
    return 1e3 * statistics.median(times), weights


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--batches", default="1,8")
    a = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="pdkv-bench-fp8-") as tmp:
        variants = make_variants(Path(tmp))
        rows = {}
        for b in (int(x) for x in a.batches.split(",")):
            for name, (folder, dtype) in variants.items():
                rows[(name, b)] = step_ms(folder, dtype, b, a.steps)
    print(f"fp8 bench: ~50M Llama, 8 layers, CPU, 1 thread, median of {a.steps} decode steps")
    print(f"{'variant':>8} {'batch':>6} {'ms/step':>9} {'vs fp32':>8} {'weights MiB':>12}")
    for (name, b), (ms, w) in rows.items():
        print(f"{name:>8} {b:>6} {ms:>9.2f} {ms / rows[('fp32', b)][0]:>8.2f} {w / 2**20:>12.1f}")
    return 0
