"""``python -m pdkv.bench soak --minutes N``: a disaggregated pair under a mixed open-loop load
with client aborts and a prefill-node restart every few minutes; reports failures (and which a
restart excuses), RSS, descriptors, threads and page pools over time, and whether they stay flat.

    cli.py      arguments, report.json / report.md / the plot, exit status
    run.py      the launch, the three tasks (load, sampler, restarter), the drain and the judging
    load.py     the arrival schedule and the client (streamed or not, planned aborts)
    probe.py    one sample of a node: /proc and its /health
    verdict.py  flat after warm-up (Theil-Sen growth within bounds) and which failures are excused
    plot.py     the PNG (matplotlib) or a hand-written SVG
"""

from pdkv.bench.soak.cli import main

__all__ = ["main"]
