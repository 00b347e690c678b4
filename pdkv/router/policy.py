"""Choosing a node for a request: prefix affinity on a consistent-hash ring, bounded by load.

Like SGLang's cache-aware router: a request whose prompt starts like an earlier one should go
where that prompt's KV (prefix cache) already is, unless that node is overloaded. The router
does not tokenize, so the key is the prompt's first ``affinity_prefix_chars`` characters —
a conversation's next turn repeats the earlier turns, so it hashes the same. The ring has
``virtual_nodes`` points per node and only healthy nodes are on it: when a node goes out only
its own keys move (to their next point), and they come back when it returns.
"""

from __future__ import annotations

import bisect
import enum
import hashlib
import itertools

from pdkv.router.nodes import Node


class Choice(enum.Enum):
    AFFINE = "affine"  # the ring's node for the prompt's prefix
    OVERLOADED = "overloaded"  # the affine node was over the load bound: least loaded instead
    LEAST_LOAD = "least_load"  # no prefix key (or policy least_load)
    ROUND_ROBIN = "round_robin"


def _h(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=8).digest(), "big")


class HashRing:
    def __init__(self, virtual_nodes: int):
        self.virtual_nodes = virtual_nodes
        self._members: tuple[str, ...] = ()
        self._points: list[int] = []
        self._owners: list[str] = []

    def owner(self, members: list[str], key: str) -> str:
        """The member owning ``key`` on the ring of ``members`` (rebuilt when they change)."""
        ms = tuple(sorted(members))
        if ms != self._members:
            pts = sorted((_h(f"{m}#{i}"), m) for m in ms for i in range(self.virtual_nodes))
            self._members, self._points, self._owners = ms, [p for p, _ in pts], [m for _, m in pts]
        i = bisect.bisect(self._points, _h(key)) % len(self._points)
        return self._owners[i]


def prefix_key(body: dict, chars: int) -> str | None:
    """The text a request's prompt starts with (completions: prompt; chat: the messages' text)."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, int)):
        prompt = prompt[0] if isinstance(prompt[0], str) else " ".join(map(str, prompt))
    if isinstance(prompt, str):
        return prompt[:chars] or None
    messages = body.get("messages")
    if isinstance(messages, list):
        parts = []
        for m in messages:
            if isinstance(m, dict):
                c = m.get("content")
                parts.append(f"{m.get('role', '')}:{c if isinstance(c, str) else ''}\n")
            if sum(map(len, parts)) >= chars:
                break
        return "".join(parts)[:chars] or None
    return None


class Policy:
    def __init__(self, name: str, virtual_nodes: int, balance_abs: float):
        self.name = name
        self.ring = HashRing(virtual_nodes)
        self.balance_abs = balance_abs
        self._rr = itertools.count()

    def choose(self, healthy: list[Node], key: str | None) -> tuple[Node, Choice]:
        """A node among ``healthy`` (not empty) for a request with prefix ``key``."""
        if self.name == "round_robin":
            return healthy[next(self._rr) % len(healthy)], Choice.ROUND_ROBIN
        # least loaded; ties rotate so equal nodes share the work
        start = next(self._rr)
        order = [healthy[(start + i) % len(healthy)] for i in range(len(healthy))]
        least = min(order, key=lambda n: n.load)
        if self.name == "least_load" or key is None:
            return least, Choice.LEAST_LOAD
        owner_url = self.ring.owner([n.url for n in healthy], key)
        owner = next(n for n in healthy if n.url == owner_url)
        mean = sum(n.load for n in healthy) / len(healthy)
        if owner.load <= mean + self.balance_abs:
            return owner, Choice.AFFINE
        return least, Choice.OVERLOADED
