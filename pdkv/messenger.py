"""The Python face of the messenger: turning a ``MessengerConfig`` into a running ``Messenger``.

Policy lives here, loops live in C: which NIC a verbs transport drives and which CPUs its poller
thread may run on come from the node topology (``pdkv.topo``) when the config says
``nics: [auto]``; an explicit NIC list always wins and is checked by the transport itself
against the devices libibverbs reports (sysfs may not list every verbs device, e.g. in a
container or with the test suite's loopback device).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

from pdkv import topo
from pdkv.config import MessengerConfig

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class MessengerPlacement:
    transport: str
    nics: tuple[str, ...]  # what the transport is told to open (verbs), () for tcp
    cpus: tuple[int, ...]  # poller affinity, () = not pinned
    reason: str


def plan_placement(cfg: MessengerConfig, gpu_bus_id: str | None = None,
                   sysfs_root: str = "/") -> MessengerPlacement:
    """Decide NICs and poller CPUs. Raises ``topo.TopologyError`` (a ValueError) with a message
    that names the problem: ``auto`` on a host without RDMA devices, ``auto`` mixed with names."""
    if cfg.transport != "verbs":
        return MessengerPlacement(cfg.transport, (), (), f"{cfg.transport}: no NIC choice")
    names = list(cfg.nics)
    if names == ["auto"] or "auto" in names:
        p = topo.placement(topo.discover(sysfs_root), gpu_bus_id, names)
        nics, cpus, reason = p.nics, p.cpus, p.reason
        if len(nics) > 1:
            # NOTE: one verbs transport drives one NIC today; the others are named so an operator
            # can see the bandwidth left on the table.
            reason += f"; using {nics[0]} (one NIC per transport), not {', '.join(nics[1:])}"
            nics = nics[:1]
    else:
        nics, cpus, reason = names, [], "explicit NIC list"
        try:  # CPUs near the named NIC, when sysfs knows it
            p = topo.placement(topo.discover(sysfs_root), gpu_bus_id, names)
            cpus, reason = p.cpus, p.reason
        except topo.TopologyError as e:
            reason += f" (not in sysfs: {e}; poller not pinned)"
    usable = sorted(set(cpus) & os.sched_getaffinity(0))
    if cpus and not usable:
        reason += "; none of those CPUs is available to this process: poller not pinned"
    return MessengerPlacement("verbs", tuple(nics), tuple(usable), reason)


def open_messenger(cfg: MessengerConfig, node_id: int, *, gpu_bus_id: str | None = None,
                   sysfs_root: str = "/"):
    """A ``pdkv._messenger.Messenger`` for this config; logs where it runs and why."""
    from pdkv._messenger import Messenger

    where = plan_placement(cfg, gpu_bus_id, sysfs_root)
    log.info("messenger: %s transport; %s", cfg.transport, where.reason)
    kwargs = dict(spin_us=cfg.spin_us, cpus=list(where.cpus) or None)
    if cfg.transport == "tcp":
        # unauthenticated data streams waiting for their hello: bounded per source address too
        kwargs.update(host=cfg.host, port=cfg.port, num_streams=cfg.num_streams,
                      max_per_source=cfg.max_control_per_source)
    elif cfg.transport == "verbs":
        # a protection domain per peer: only a connected, granted peer can write (pdkv/disagg/grants.py)
        kwargs.update(nics=list(where.nics), isolate_peers=True)
    return Messenger(cfg.transport, node_id, **kwargs)


# ---- the asyncio side: events and connections ----------------------------------------------------

def new_node_id(cfg: MessengerConfig) -> int:
    """``messenger.node_id`` or, when 0, a random 63-bit id (distinct per process)."""
    import secrets

    return cfg.node_id or (secrets.randbits(62) | 1)


class EventPump:
    """Delivers a messenger's completion events on an asyncio loop: the messenger's eventfd is
    watched with ``add_reader`` and each readable edge drains every pending event into
    ``on_event(event)`` (a ``pdkv._messenger.Event``). No thread, no polling from Python."""

    def __init__(self, messenger, loop, on_event):
        self.messenger, self.loop, self.on_event = messenger, loop, on_event
        self._fd = messenger.fileno()
        loop.add_reader(self._fd, self._ready)

    def _ready(self) -> None:
        while True:
            events = self.messenger.drain()
            for ev in events:
                try:
                    self.on_event(ev)
                except Exception:  # noqa: BLE001 - one bad handler must not stop the others
                    log.exception("messenger event handler failed for %s", ev)
            if len(events) < 4096:
                return

    def close(self) -> None:
        if self._fd is not None:
            self.loop.remove_reader(self._fd)
            self._fd = None
