"""CPU pinning of one node: ``parallel.cpus`` in a role config, in taskset/cpuset list syntax
("0", "0-3", "0,2,4-7"; empty = every CPU the process may already use).

Applied once at start-up, before the engine loads: the process's affinity is set with
``os.sched_setaffinity`` (threads and child processes started later inherit it, so tensor-parallel
ranks and the messenger thread stay inside the set) and torch gets one thread per CPU of the set,
so an A/B comparison gives every architecture exactly the cores it was budgeted (NUMA pinning too).
"""

from __future__ import annotations

import logging
import os

log = logging.getLogger(__name__)


def parse_cpu_list(text: str) -> tuple[int, ...]:
    """'0,2-3' -> (0, 2, 3); '' -> (). ValueError names the bad part."""
    cpus: set[int] = set()
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        lo, dash, hi = part.partition("-")
        if not lo.isdigit() or (dash and not hi.isdigit()):
            raise ValueError(f"{part!r} is not a CPU number or range like 0-3")
        a, b = int(lo), int(hi) if dash else int(lo)
        if b < a:
            raise ValueError(f"range {part!r} runs backwards")
        cpus.update(range(a, b + 1))
    return tuple(sorted(cpus))


def pin_cpus(text: str) -> tuple[int, ...]:
    """Pin this process to the CPUs of ``text`` and give torch as many threads; () when empty.
    OSError when the set names CPUs this machine (or cgroup) does not allow."""
    cpus = parse_cpu_list(text)
    if not cpus:
        return ()
    if not hasattr(os, "sched_setaffinity"):
        raise OSError("parallel.cpus needs os.sched_setaffinity (Linux)")
    allowed = os.sched_getaffinity(0)
    missing = sorted(set(cpus) - allowed)
    if missing:
        raise OSError(f"parallel.cpus={text!r} names CPUs {missing} that this process may not use "
                      f"(allowed: {sorted(allowed)})")
    os.sched_setaffinity(0, cpus)
    import torch

    torch.set_num_threads(len(cpus))
    log.info("pinned to CPUs %s with %d torch threads", list(cpus), len(cpus))
    return cpus
