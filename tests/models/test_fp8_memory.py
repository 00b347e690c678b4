"""Loading an FP8 checkpoint never holds a dequantized (bf16 / float32) copy: in a fresh process,
the anonymous resident memory (RssAnon: the heap, not the safetensors file's mmap pages, which
the kernel may drop at will) sampled after every tensor the loader copies in stays within
1.1 x the model's bytes in their real dtype (FP8 + scales + the unquantized tensors) plus one
layer's worth, and the FP8 part is most of those bytes. A bf16 copy of the quantized weights
would add twice their FP8 bytes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from _fp8 import make_fp8_pair
from _hf import VOCAB, save_hf_model

EXPERTS = 16
ROOT = Path(__file__).resolve().parents[2]
PROBE = r"""
import json, sys, torch
def anon():
    for line in open("/proc/self/status"):
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024
from pdkv.models.loader import load_model
from pdkv.models.fp8_load import weight_bytes
torch.ones(1) @ torch.ones(1)  # torch's lazy state before the baseline: its CPU ops, and
with torch.device("meta"):  # the meta device's (~70 MB once, whatever the model's size)
    torch.nn.Embedding(8, 8)
base, peak = anon(), [0]
def progress(done, total):
    peak[0] = max(peak[0], anon() - base)
loaded = load_model(sys.argv[1], progress=progress)
m = loaded.model
fp8 = sum(p.numel() for p in m.parameters() if p.dtype == torch.float8_e4m3fn)
print(json.dumps({"peak": peak[0], "weights": weight_bytes(m), "fp8": fp8}))
"""


def test_peak_memory_while_loading_is_the_fp8_bytes(tmp_path, tiny_model_dir):
    kw = dict(hidden_size=256, intermediate_size=512, moe_intermediate_size=256, vocab_size=VOCAB,
              num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=128,
              kv_lora_rank=128, qk_rope_head_dim=64, qk_nope_head_dim=64, v_head_dim=64,
              n_routed_experts=EXPERTS, num_experts_per_tok=2, n_group=1, topk_group=1, n_shared_experts=1,
              first_k_dense_replace=1, max_position_embeddings=256)
    save_hf_model("DeepseekV3Config", "DeepseekV3ForCausalLM", kw, tmp_path / "src", tiny_model_dir)
    make_fp8_pair(tmp_path / "src", tmp_path / "fp8", tmp_path / "deq")
    out = subprocess.run([sys.executable, "-c", PROBE, str(tmp_path / "fp8")], capture_output=True, text=True,
                         cwd=ROOT, timeout=120, check=False)
    assert out.returncode == 0, out.stderr[-2000:]
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert r["fp8"] > 0.8 * r["weights"], r  # the model is mostly FP8 bytes
    one_layer = EXPERTS * 3 * 256 * 256  # a MoE layer's FP8 experts
    assert r["peak"] <= 1.1 * r["weights"] + one_layer, r
    # a bf16 copy of the FP8 weights would need 2 bytes each more: far above the bound
    assert 1.1 * r["weights"] + one_layer < r["weights"] + 2 * r["fp8"]
    print(json.dumps(r))
