"""A prefill node's load, as its heartbeats carry it to each decode node.

Every HEARTBEAT a prefill node sends on a decode node's control channel carries::

    load: {queued_tokens, running, waiting, free_pages, seen}

- ``queued_tokens``: prompt tokens of its live jobs not computed yet (waiting and running: the
  work ahead of a new PREFILL);
- ``running`` / ``waiting``: jobs that have computed a chunk / not yet;
- ``free_pages``: KV pages it could give a new job now (free + evictable cached ones);
- ``seen``: PREFILLs it has received on THIS channel. The decode node counts the tokens it sent
  after the ``seen``-th as still missing from the report, so a burst sent between two
  heartbeats is not piled onto one node (pdkv/disagg/choice.py).

The field is optional (an older prefill node sends plain heartbeats) and untrusted: a load that
is not a map of non-negative integers is ignored (``PrefillLoad.parse`` raises MessageError naming
the first bad field; the caller logs it and treats the node as one that reports no load).
"""

from __future__ import annotations

from pdkv.disagg.jobs import JobState, JobTable
from pdkv.disagg.messages import PrefillLoad


def parse_load(heartbeat: dict) -> PrefillLoad | None:
    """The load a HEARTBEAT carries, checked (pdkv/disagg/messages.py PrefillLoad.parse)."""
    return PrefillLoad.parse(heartbeat.get("load"))


def measure_load(jobs: JobTable, stats: dict | None, seen: int) -> PrefillLoad:
    """This prefill node's load now (event loop: the job table is the loop's; ``num_computed`` of
    a job is the engine thread's, read without a lock: a count one step old is fine here).
    ``stats``: the engine's last LLMEngine.stats() (None before the first step)."""
    queued = running = waiting = 0
    for job in list(jobs.values()):
        if job.state != JobState.COMPUTING:
            continue
        queued += max(0, len(job.tokens) - job.num_computed)
        if job.num_computed:
            running += 1
        else:
            waiting += 1
    free = 0 if stats is None else int(stats.get("num_pages_free", 0))  # free + evictable (allocator.num_free)
    return PrefillLoad(queued, running, waiting, free, seen)
