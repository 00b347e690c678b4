"""What the soak samples of each node over time, the way an operator would read it: from /proc
(resident memory, open file descriptors and threads of the node's processes, tensor-parallel
ranks included) and from the node's own GET /health (its page pool: free, in use, quarantined
-- held until no write can land in them -- and cached).

A sample of a node that is down (killed, restarting) has ``up: False`` and no numbers; its
``start`` counts the node's incarnations, so a restarted node's samples can be judged per life.
"""

from __future__ import annotations

import json
import os
import urllib.request
from dataclasses import asdict, dataclass

from pdkv.bench.ab.resources import rss_bytes


@dataclass(frozen=True)
class NodeSample:
    t_s: float
    node: str
    start: int  # incarnation (1 = first start)
    up: bool
    rss_bytes: int | None = None
    fds: int | None = None
    threads: int | None = None
    pages_total: int | None = None
    pages_free: int | None = None
    pages_used: int | None = None  # held by live requests (or quarantined, or cached)
    pages_held: int | None = None  # quarantined: a write may still land
    pages_cached: int | None = None  # prefix cache, evictable

    def as_dict(self) -> dict:
        return asdict(self)


def num_fds(pid: int) -> int:
    try:
        return len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return 0


def num_threads(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("Threads:"):
                    return int(line.split()[1])
    except (OSError, ValueError):
        pass
    return 0


def health(url: str, timeout: float = 5.0) -> dict | None:
    try:
        with urllib.request.urlopen(url + "/health", timeout=timeout) as r:
            return json.loads(r.read())
    except (OSError, ValueError):
        return None


def sample_node(node, t_s: float) -> NodeSample:
    """One sample of a pdkv.bench.ab.launch.NodeProc (blocking: /proc reads and one HTTP GET)."""
    pids = node.pids()
    h = health(node.url) if pids else None
    if not pids or h is None:
        return NodeSample(t_s, node.name, node.num_starts, False)
    total, free = h.get("num_pages_total"), h.get("num_pages_free")
    return NodeSample(t_s, node.name, node.num_starts, True,
                      rss_bytes=sum(rss_bytes(p) for p in pids), fds=sum(num_fds(p) for p in pids),
                      threads=sum(num_threads(p) for p in pids), pages_total=total, pages_free=free,
                      pages_used=None if total is None or free is None else total - free,
                      pages_held=h.get("num_pages_held"), pages_cached=h.get("num_pages_cached"))
