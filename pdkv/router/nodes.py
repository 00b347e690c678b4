"""The nodes behind the router: their health and load, kept fresh by polling each node's /load.

One asyncio task per node polls ``GET /load`` every ``poll_interval_s``. A poll that is refused,
reset or answered non-200 takes the node out at once; polls that time out take it out once no
poll has succeeded for ``down_after_s``; the next good poll takes it back.
The proxy also takes a node out the moment a connection to it fails, without waiting for the
poller. Load is what the router itself has in flight to the node (exact, immediate) or what the
node last reported (it also counts requests that reached it by other ways), whichever is larger.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import time
from dataclasses import dataclass, field

import aiohttp

log = logging.getLogger(__name__)


class NodeHealth(enum.Enum):
    UNKNOWN = "unknown"  # not polled yet: not chosen
    UP = "up"
    DOWN = "down"


@dataclass
class Node:
    url: str  # http://host:port, no trailing slash
    health: NodeHealth = NodeHealth.UNKNOWN
    in_flight: int = 0  # requests the router is proxying to it now (event loop only)
    reported: dict = field(default_factory=dict)  # its last /load body
    last_error: str = ""
    changed_at: float = field(default_factory=time.monotonic)
    last_ok: float = field(default_factory=time.monotonic)  # last good poll (start-up counts as one)
    draining: bool = False  # its etcd record says so (its /load's "draining" counts too)

    @property
    def choosable(self) -> bool:
        """In, and not draining: may get new requests."""
        return self.healthy and not self.draining and not self.reported.get("draining", False)

    @property
    def healthy(self) -> bool:
        return self.health is NodeHealth.UP

    @property
    def load(self) -> float:
        r = self.reported
        return max(self.in_flight, r.get("in_flight", 0), r.get("num_running", 0) + r.get("num_waiting", 0))

    def mark(self, health: NodeHealth, why: str = "") -> None:
        if health is not self.health:
            if health is NodeHealth.DOWN:
                log.warning("node %s is out: %s", self.url, why)
            elif health is NodeHealth.UP:
                log.info("node %s is in", self.url)
            self.health = health
            self.changed_at = time.monotonic()
        if why:
            self.last_error = why

    def describe(self) -> dict:
        draining = self.draining or self.reported.get("draining", False)
        return {"url": self.url, "health": self.health.value, **({"draining": True} if draining else {}), "in_flight": self.in_flight, "load": self.reported,
                **({"last_error": self.last_error} if self.health is not NodeHealth.UP and self.last_error else {})}


class NodePoller:
    """Polls every node's /load until ``stop()``; ``wait_first_round()`` for start-up."""

    def __init__(self, nodes: list[Node], session: aiohttp.ClientSession, interval_s: float, timeout_s: float,
                 down_after_s: float, on_change=None):
        self.nodes = nodes
        self.down_after_s = down_after_s
        self.session = session
        self.interval_s = interval_s
        self.timeout = aiohttp.ClientTimeout(total=timeout_s)
        self.on_change = on_change  # called with a Node after each poll (metrics)
        self._tasks: dict[str, asyncio.Task] = {}
        self._first = asyncio.Event()  # every node polled once, or one of them up

    def start(self) -> None:
        for n in self.nodes:
            self._tasks[n.url] = asyncio.create_task(self._run(n), name=f"poll {n.url}")

    def add(self, node: Node) -> None:
        """A node that joined (fleet discovery): polled from now on."""
        if node.url not in self._tasks:
            self.nodes.append(node)
            self._tasks[node.url] = asyncio.create_task(self._run(node), name=f"poll {node.url}")

    def remove(self, url: str) -> None:
        """A node that left: no longer polled nor chosen."""
        task = self._tasks.pop(url, None)
        if task is not None:
            task.cancel()
        self.nodes[:] = [n for n in self.nodes if n.url != url]

    async def stop(self) -> None:
        for t in self._tasks.values():
            t.cancel()
        await asyncio.gather(*self._tasks.values(), return_exceptions=True)

    async def wait_first_round(self, timeout: float) -> None:
        try:
            await asyncio.wait_for(self._first.wait(), timeout)
        except asyncio.TimeoutError:
            pass

    async def poll_once(self, node: Node) -> None:
        try:
            async with self.session.get(node.url + "/load", timeout=self.timeout) as r:
                if r.status != 200:
                    node.mark(NodeHealth.DOWN, f"GET /load answered {r.status}: {(await r.text())[:200]}")
                else:
                    node.reported = await r.json()
                    node.last_ok = time.monotonic()
                    node.mark(NodeHealth.UP)
        except asyncio.TimeoutError:
            silent = time.monotonic() - node.last_ok
            if silent >= self.down_after_s:
                node.mark(NodeHealth.DOWN, f"no answer to GET /load for {silent:.1f} s")
        except (aiohttp.ClientError, OSError, ValueError) as e:
            node.mark(NodeHealth.DOWN, f"GET /load failed: {type(e).__name__}: {e}")
        if self.on_change is not None:
            self.on_change(node)

    async def _run(self, node: Node) -> None:
        while True:
            await self.poll_once(node)
            if node.healthy or all(n.health is not NodeHealth.UNKNOWN for n in self.nodes):
                self._first.set()
            await asyncio.sleep(self.interval_s)
