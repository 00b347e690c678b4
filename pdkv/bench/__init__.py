"""Benchmarks: `python -m pdkv.bench <name> [args]`. Each prints numbers and ratios against a
baseline measured in the same run, and writes them as JSON."""
