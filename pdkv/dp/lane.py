"""A lane follower (tp x dp): TP rank t >= 1 of one data-parallel rank, and rank ``dp_rank`` of
lane t, the dispatch group of TP rank t of every DP rank (pdkv/dp/expert.py).

Started by its DP rank's TP leader (pdkv/tp/leader.py, ``lanes``) as ``python -m pdkv.dp.lane
CONTROL_FD [FD_SOCKET]``; it is a TP follower (pdkv/tp/worker.py: the same channel, messages and
exits) that also joins its lane's process group over the DP group's store before its model
loads, so its MoE blocks send their tokens to lane t of the experts' DP ranks, and that runs a
dummy forward (its lane's all-to-alls, no tokens) when its DP rank had none this step.
"""

from __future__ import annotations

import datetime
import sys


def join_lane(init: dict, device):
    """This process's ExpertGroup: rank ``dp_rank`` of lane ``rank`` (its TP rank)."""
    import torch.distributed as dist  # noqa: PLC0415

    from pdkv.dp.expert import ExpertGroup  # noqa: PLC0415

    store = dist.TCPStore(init["dp_host"], init["dp_port"], None, False,
                          timeout=datetime.timedelta(seconds=init["dp_store_timeout_s"]))
    return ExpertGroup(init["dp_rank"], init["dp"], store, device, init["timeout_s"], lane=init["rank"])


def main(argv: list[str]) -> int:
    from pdkv.tp.worker import main as follow  # noqa: PLC0415

    return follow(argv, join_lane, name="dp-lane")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
