"""`python -m pdkv.bench engine --model DIR` on a model whose vocabulary is smaller than the bench
model's 32000 tokens: every prompt id it draws must be inside that vocabulary (no timing is
asserted)."""

from __future__ import annotations

import json

from pdkv.bench import engine as bench_engine
from pdkv.tiny_model import make_tiny_model


def test_engine_bench_on_a_small_vocabulary(tmp_path):
    model = make_tiny_model(tmp_path / "m", vocab_size=300, hidden_size=32, num_layers=1,
                            num_heads=2, num_kv_heads=1)
    out = tmp_path / "engine.json"
    assert bench_engine.main(["--model", str(model), "--batch-sizes", "2", "--prompt-len", "12",
                              "--new-tokens", "3", "--repeats", "1", "--no-hf", "--threads", "1",
                              "--out", str(out)]) == 0
    rows = json.loads(out.read_text())
    rows = rows["results"]
    assert [r["batch"] for r in rows] == [2]
    assert rows[0]["pdkv_decode_tok_s"] > 0


def test_engine_bench_bfloat16_with_a_profile(tmp_path, capsys):
    """--dtype bfloat16 halves the floor's weight bytes; --profile prints the decode steps' own
    CPU time by function, the GEMM front among them."""
    model = make_tiny_model(tmp_path / "m", vocab_size=300, hidden_size=32, num_layers=1,
                            num_heads=2, num_kv_heads=1)
    reports = {}
    for dtype in ("float32", "bfloat16"):
        out = tmp_path / f"{dtype}.json"
        assert bench_engine.main(["--model", str(model), "--batch-sizes", "3", "--prompt-len", "12",
                                  "--new-tokens", "4", "--repeats", "1", "--no-hf", "--threads", "1",
                                  "--dtype", dtype, "--profile", "--out", str(out)]) == 0
        reports[dtype] = json.loads(out.read_text())
    assert reports["bfloat16"]["dtype"] == "bfloat16"
    assert reports["bfloat16"]["decode_weight_bytes"] * 2 == reports["float32"]["decode_weight_bytes"]
    assert reports["float32"]["gemm_path"] in ("avx512", "avx2", "pairs", "none")
    text = capsys.readouterr().out
    assert text.count("profile B=3:") == 2 and "linear" in text
