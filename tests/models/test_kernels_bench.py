"""`python -m pdkv.bench kernels` runs and reports what it measured (a tiny run: no timing is
asserted, only that every row has its numbers and the kernel rows only where it applies)."""

from __future__ import annotations

import json

from pdkv.models import cpu_kernels
from pdkv.bench import kernels


def test_kernels_bench_reports_every_row(tmp_path, capsys):
    out = tmp_path / "k.json"
    assert kernels.main(["--rows", f"1,{cpu_kernels.MAX_ROWS + 1}", "--contexts", "20", "--rounds", "1",
                         "--ring-mb", "2", "--out", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["read_gbs"] > 0
    assert len(r["gemm"]) == 2 * len(kernels.SHAPES)
    for row in r["gemm"]:
        assert row["torch_out_in_us"] > 0 and row["torch_in_out_us"] > 0
        assert ("kernel_us" in row) == (cpu_kernels.AVAILABLE and row["rows"] <= cpu_kernels.MAX_ROWS)
    if cpu_kernels.AVAILABLE:
        assert [(a["heads"], a["context"]) for a in r["attention"]] == [("gqa", 20), ("gqa2", 20), ("mla", 20)]
        assert all(a["torch_us"] > 0 and a["kernel_us"] > 0 for a in r["attention"])
    assert "read bandwidth" in capsys.readouterr().out
