"""`python -m pdkv.bench disagg` sends the same prompt on every repeat: each one must still move
its KV (the decode node's prefix cache would otherwise hold it after the first and the bench
would report 0 bytes and 0 ms). No timing is asserted."""

from __future__ import annotations

from pdkv.bench.disagg import run_mode
from pdkv.tiny_model import make_tiny_model


def test_every_repeat_moves_the_prompts_kv(tmp_path):
    model = make_tiny_model(tmp_path / "m", vocab_size=300, hidden_size=32, num_layers=2,
                            num_heads=2, num_kv_heads=1)
    # longer than disagg.local_prefill_max_tokens (128), so it is prefilled remotely
    prompt = [3 + i % 290 for i in range(200)]
    out = run_mode(str(model), True, {200: prompt}, repeats=2, page_size=16)
    page_nbytes, layers = out.pop("geometry")
    # 199 prompt tokens (the last is held back) fill 13 pages of 16 in every layer, plus the
    # last prompt row's hidden state (32 float32)
    assert out[200]["bytes"] == 13 * layers * page_nbytes + 32 * 4
