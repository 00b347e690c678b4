"""Scheduling policies: the order requests wait in and which running request is preempted.

The scheduler (pdkv/engine/scheduler.py) keeps its queues and pages; a policy only says where a
request goes in a queue and which one of a list gives its pages back. Two, as in vLLM v1
(``create_request_queue(policy)`` and its preemption choice):

- ``fcfs``: arrival order; a preempted or landed request goes back to the front; the victim is
  the newest running request (the last one in the running list).
- ``priority``: the request's ``priority`` (lower runs first), ties by arrival; a preempted or
  landed request goes back to its place by that order; the victim is the running request of
  the lowest priority, the latest arrival among equals.

``scheduler.policy`` in the config picks one; the request's ``priority`` field is refused (400)
unless the policy is ``priority``, as vLLM does.
"""

from __future__ import annotations

from collections import deque

from pdkv.engine.request import Request


class FCFS:
    name = "fcfs"

    def insert(self, queue: deque[Request], req: Request, front: bool = False) -> None:
        """Puts ``req`` into ``queue`` (``front``: it was waiting already: preempted, or its
        remote KV landed)."""
        if front:
            queue.appendleft(req)
        else:
            queue.append(req)

    def victim(self, reqs: list[Request]) -> Request:
        """The request of ``reqs`` (in running or waiting order) that gives its pages back."""
        return reqs[-1]


class Priority(FCFS):
    name = "priority"

    @staticmethod
    def key(req: Request) -> tuple:
        # seq: submission order on this node, so equal arrival stamps still have one order
        return req.priority, req.arrival, req.seq

    def insert(self, queue: deque[Request], req: Request, front: bool = False) -> None:
        # From the back: a newcomer of the common priority goes last without a scan.
        k, i = self.key(req), len(queue)
        while i > 0 and self.key(queue[i - 1]) > k:
            i -= 1
        queue.insert(i, req)

    def victim(self, reqs: list[Request]) -> Request:
        return max(reqs, key=self.key)


POLICIES = {p.name: p for p in (FCFS, Priority)}


def make_policy(name: str) -> FCFS:
    """The policy called ``name`` (``scheduler.policy``); ValueError naming the choices otherwise."""
    try:
        return POLICIES[name]()
    except (KeyError, TypeError):
        raise ValueError(f"scheduler.policy must be one of {', '.join(POLICIES)}, got {name!r}") from None
