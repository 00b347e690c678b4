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


def test_profile_parts_cover_the_steps_own_time(tmp_path):
    """--profile's parts split all of the decode steps' own CPU time (nothing lost or counted
    twice) and put the GEMM fronts' time under GEMMs and the attention kernel's under attention."""
    import cProfile
    import pstats
    import time

    from pdkv.bench import _profile
    from pdkv.config import KVCacheConfig, ModelConfig, SchedulerConfig
    from pdkv.engine import LLMEngine

    model = make_tiny_model(tmp_path / "m", vocab_size=300, hidden_size=32, num_layers=2,
                            num_heads=2, num_kv_heads=1)
    engine = LLMEngine(ModelConfig(path=str(model)), KVCacheConfig(page_size=4, num_pages=32),
                       SchedulerConfig(max_num_seqs=4), num_threads=1)
    prof = cProfile.Profile(time.thread_time)
    bench_engine.bench_pdkv(engine, [[1, 2, 3, 4, 5]] * 3, 6, prof)
    stats = pstats.Stats(prof)
    parts = _profile.by_part(stats)
    own = sum(v[2] for v in stats.stats.values())
    assert abs(sum(parts.values()) - own) <= 1e-6 * max(own, 1.0)
    assert parts[_profile.GEMM] > 0 and parts[_profile.ATTENTION] > 0 and parts[_profile.SCHEDULER] > 0
    assert set(parts) == set(_profile.PARTS)


def test_part_of_functions():
    from pdkv.bench._profile import ATTENTION, GEMM, LAYERS, SAMPLER, part_of

    assert part_of(("/x/models/cpu_kernels.py", 64, "linear")) == GEMM
    assert part_of(("/x/models/cpu_kernels.py", 142, "rms_norm")) == LAYERS
    assert part_of(("/x/models/attention/cpu_decode.py", 27, "decode")) == ATTENTION
    assert part_of(("/x/pdkv/engine/sampler.py", 41, "__call__")) == SAMPLER
    assert part_of(("~", 0, "<built-in method torch._C._nn.linear>")) is None  # its caller's part
