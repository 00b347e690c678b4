"""The A/B trace-replay harness: colocated vs chunked vs disaggregated serving on one trace and one
hardware budget (``python -m pdkv.bench ab``, docs/AB.md). One concept per module:

    traces / synth      trace files and synthetic traces        workload / prompts  what is sent
    archs / launch      architectures and their node processes  client              the open-loop replay
    scrape / resources  the nodes' /metrics, memory, CPU, energy metrics             client-side numbers
    fault               kill / restart / recovery               verdict             the seed's rule
    runner / cli        orchestration and flags                 report / schema / plots  the outputs
"""


def main(argv: list[str]) -> int:
    from pdkv.bench.ab.cli import main as _main

    return _main(argv)
