"""The Python face of the messenger: turning a ``MessengerConfig`` into a running ``Messenger``.

Policy lives here, loops live in C: which NICs a verbs transport drives, which NIC each TP
rank's pages leave through, and which CPUs its poller thread may run on come from the node
topology (``pdkv.topo``) when the config says ``nics: [auto]``: one transport opens every NIC
some rank is nearest to (csrc/verbs_multi.h), and each rank's region keys name its own NIC
(``rank_key``). An explicit per-rank list (``rank_nics``) wins, then an explicit NIC list; names
are checked by the transport itself against the devices libibverbs reports (sysfs may not list
every verbs device, e.g. in a container or with the test suite's loopback device).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, replace

from pdkv import topo, transports
from pdkv.config import MessengerConfig

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class MessengerPlacement:
    transport: str
    nics: tuple[str, ...]  # what the transport is told to open (verbs NICs, libfabric domains), () for tcp
    cpus: tuple[int, ...]  # poller affinity, () = not pinned
    reason: str
    # verbs, libfabric: per TP rank, the indices into `nics` its pages leave through (nearest first); a
    # request's writes from rank r use one of them (pdkv.shard.pick_nic)
    rank_nics: tuple[tuple[int, ...], ...] = ()


def _unique(names) -> list[str]:
    out: list[str] = []
    for n in names:
        if n not in out:
            out.append(n)
    return out


def plan_placement(cfg: MessengerConfig, gpu_bus_id: str | None = None,
                   sysfs_root: str = "/", *, gpu_bus_ids=None, num_ranks: int = 1) -> MessengerPlacement:
    """Decide NICs (every NIC any rank uses: one transport drives them all), each TP rank's NICs,
    and the poller's CPUs. ``gpu_bus_ids``: each rank's GPU (None where unknown or no GPU);
    default ``[gpu_bus_id]`` then unknown for ranks 1.. . Raises ``topo.TopologyError`` (a
    ValueError) naming the problem: ``auto`` on a host without RDMA devices, ``auto`` mixed with
    names, a rank NIC that does not exist."""
    placer = _PLACERS.get(cfg.transport)
    if placer is None:
        return MessengerPlacement(cfg.transport, (), (), f"{cfg.transport}: no NIC choice")
    return placer(cfg, gpu_bus_id, sysfs_root, gpu_bus_ids, num_ranks)


def _verbs_placement(cfg: MessengerConfig, gpu_bus_id, sysfs_root, gpu_bus_ids, num_ranks) -> MessengerPlacement:
    num_ranks = max(num_ranks, len(cfg.rank_nics), len(gpu_bus_ids or ()), 1)
    gpus = list(gpu_bus_ids) if gpu_bus_ids else [gpu_bus_id]
    gpus += [None] * (num_ranks - len(gpus))
    names = list(cfg.nics)
    auto = names == ["auto"] or "auto" in names
    if cfg.rank_nics:  # explicit per-rank list: wins over the topology
        nics = _unique(cfg.rank_nics) if auto else names
        per_rank = [(nics.index(n),) for n in cfg.rank_nics]
        cpus, reason = _cpus_near(nics, gpus[0], sysfs_root)
        reason = "explicit per-rank NIC list (messenger.rank_nics)" + reason
    elif auto:
        t = topo.discover(sysfs_root)
        every = topo.placement(t, None, names)  # no GPU: every NIC with an ACTIVE port
        chosen = [topo.placement(t, g, names) if g else None for g in gpus]
        spread = _spread(len(every.nics), num_ranks)
        rank_names = [p.nics if p else [every.nics[i] for i in spread[r]] for r, p in enumerate(chosen)]
        nics = _unique(n for rn in rank_names for n in rn)
        per_rank = [tuple(nics.index(n) for n in rn) for rn in rank_names]
        first = chosen[0] or every
        cpus = first.cpus
        reason = first.reason
        if num_ranks > 1:
            reason += "; ranks -> NICs: " + ", ".join(f"{r}: {'+'.join(rn)}" + ("" if chosen[r] else " (no GPU: spread)")
                                                     for r, rn in enumerate(rank_names))
    else:
        nics = names
        per_rank = _spread(len(nics), num_ranks)
        cpus, reason = _cpus_near(nics, gpus[0], sysfs_root)
        reason = "explicit NIC list" + reason + f"; ranks -> NICs: {_spread(len(nics), num_ranks)}"
    usable = sorted(set(cpus) & os.sched_getaffinity(0))
    if cpus and not usable:
        reason += "; none of those CPUs is available to this process: poller not pinned"
    return MessengerPlacement("verbs", tuple(nics), tuple(usable), reason, tuple(per_rank))


def _fabric_placement(cfg: MessengerConfig, gpu_bus_id, sysfs_root, gpu_bus_ids, num_ranks) -> MessengerPlacement:
    """libfabric, as verbs over several NICs: one transport drives every domain some rank uses
    (csrc/fabric_link.c) and each rank's pages go through its own. ``domains: [auto]`` on EFA
    reads the topology exactly as ``nics: [auto]`` does for verbs (EFA devices are RDMA devices
    in sysfs; libfabric names a device's RDM domain ``<device>-rdm``): each rank the EFA
    device(s) nearest its GPU (an AWS p5 has four per GPU: the seed's replica choice picks one
    per request, pdkv.shard.pick_nic). Named domains are dealt to the ranks in turn; none: the
    provider's first domain, one path."""
    lf = cfg.libfabric
    if list(lf.domains) == ["auto"]:
        if lf.provider != "efa":
            raise topo.TopologyError(f"messenger.libfabric.domains [auto] picks EFA devices from the "
                                     f"topology: it needs provider efa, not {lf.provider!r} (name the domains)")
        v = _verbs_placement(replace(cfg, nics=("auto",), rank_nics=()), gpu_bus_id, sysfs_root, gpu_bus_ids,
                             num_ranks)
        rank_names, why = [[v.nics[i] for i in r] for r in v.rank_nics], ""
        if len(v.nics) > MAX_DOMAINS:  # a p5 at TP8: 32 devices, 4 per GPU; keys name 16
            keep = max(1, MAX_DOMAINS // len(rank_names))
            rank_names = [r[:keep] for r in rank_names]
            why = f"; {MAX_DOMAINS} domains at most per transport: each rank's {keep} nearest"
        names = _unique(n for r in rank_names for n in r)
        domains = tuple(f"{n}-rdm" for n in names)
        per_rank = tuple(tuple(names.index(n) for n in r) for r in rank_names)
        return MessengerPlacement("libfabric", domains, v.cpus, f"libfabric efa: domains {', '.join(domains)} "
                                  f"({v.reason}){why}", per_rank)
    if not lf.domains:
        return MessengerPlacement("libfabric", (), (), f"libfabric {lf.provider}: the provider's first domain")
    num_ranks = max(num_ranks, len(gpu_bus_ids or ()), 1)
    per_rank = _spread(len(lf.domains), num_ranks)
    return MessengerPlacement("libfabric", tuple(lf.domains), (),
                              f"libfabric {lf.provider}: domains {list(lf.domains)}; ranks -> domains: {per_rank}",
                              tuple(per_rank))


MAX_DOMAINS = 16  # devices one libfabric transport drives (csrc/fabric_internal.h FB_MAX_DEVS)


# transports that drive named devices, chosen from the node's topology; the others have one path
_PLACERS = {"verbs": _verbs_placement, "libfabric": _fabric_placement}


def _spread(num_nics: int, num_ranks: int) -> list[tuple[int, ...]]:
    """NICs without a GPU to go by, dealt to ranks in turn: rank r gets NICs r, r + tp, ... (each
    NIC used by one rank when there are at least as many NICs as ranks), else NIC r mod n."""
    return [tuple(range(r, num_nics, num_ranks)) or (r % num_nics,) for r in range(num_ranks)]


def _cpus_near(nics: list[str], gpu: str | None, sysfs_root: str) -> tuple[list[int], str]:
    """CPUs near the named NICs, when sysfs knows them (else not pinned, said in the reason)."""
    try:
        p = topo.placement(topo.discover(sysfs_root), gpu, nics)
        return p.cpus, p.reason.removeprefix("explicit NIC list")
    except topo.TopologyError as e:
        return [], f" (not in sysfs: {e}; poller not pinned)"


def open_messenger(cfg: MessengerConfig, node_id: int, *, gpu_bus_id: str | None = None,
                   sysfs_root: str = "/", gpu_bus_ids=None, num_ranks: int = 1):
    """A ``pdkv._messenger.Messenger`` for this config; logs where it runs and why. Its
    ``rank_nics`` say which NIC(s) each TP rank's pages leave through (verbs)."""
    from pdkv._messenger import Messenger

    where = plan_placement(cfg, gpu_bus_id, sysfs_root, gpu_bus_ids=gpu_bus_ids, num_ranks=num_ranks)
    log.info("messenger: %s transport; %s", cfg.transport, where.reason)
    options = transports.options_class(cfg.transport).from_config(cfg, where)
    m = Messenger(cfg.transport, node_id, options, spin_us=cfg.spin_us, cpus=list(where.cpus) or None)
    m.rank_nics = where.rank_nics
    return m


def rank_key(messenger, key: int, rank: int, choice: int = 0) -> int:
    """The key of region ``key`` on the NIC that carries rank ``rank``'s pages (``choice``: which
    of that rank's NICs, see pdkv.shard.pick_nic); ``key`` itself on tcp/fake or when the
    messenger has no rank placement (a single path)."""
    per_rank = getattr(messenger, "rank_nics", ()) or ()
    if not per_rank:
        return key
    nics = per_rank[rank % len(per_rank)]
    return messenger.nic_key(key, nics[choice % len(nics)])


def rank_keys(messenger, key: int, rank: int) -> int | tuple[int, ...]:
    """``rank_key`` for each of rank ``rank``'s NICs: one int when it has one NIC (or one path),
    else a tuple to pick from per request (pdkv.shard.pick_nic)."""
    per_rank = getattr(messenger, "rank_nics", ()) or ()
    n = len(per_rank[rank % len(per_rank)]) if per_rank else 1
    keys = tuple(rank_key(messenger, key, rank, c) for c in range(n))
    return keys[0] if n == 1 else keys


class NicMetrics:
    """A Prometheus collector of what each NIC of a verbs messenger (each domain of a libfabric
    one) carried (its nic_stats, read at scrape time): ``pdkv_nic_write_bytes_total{nic}`` /
    ``pdkv_nic_writes_total{nic}`` (this node's writes completed through the NIC),
    ``pdkv_nic_write_errors_total{nic}``,
    ``pdkv_nic_landed_bytes_total{nic}`` / ``pdkv_nic_landed_writes_total{nic}`` (peers' writes
    with an immediate that landed through it), and the gauge ``pdkv_nic_queue_pairs{nic}`` (QPs
    on the NIC now: only the NIC pairs the links' writes use are made, pdkv/disagg/sharded.py).
    Nothing for tcp/fake or a closed messenger."""

    FIELDS = (("write_bytes", "bytes_done", "Bytes of this node's writes completed through the NIC."),
              ("writes", "writes_done", "This node's writes completed through the NIC."),
              ("write_errors", "errors", "This node's writes through the NIC that failed."),
              ("landed_bytes", "imm_bytes", "Bytes of peers' writes (with an immediate) that landed through the NIC."),
              ("landed_writes", "imms", "Peers' writes with an immediate that landed through the NIC."))

    def __init__(self, messenger, model_name: str, role: str):
        self.m, self.labels = messenger, (model_name, role)

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        try:
            stats = self.m.nic_stats()
        except Exception:  # noqa: BLE001 - closed messenger: no samples
            stats = []
        for name, field, doc in self.FIELDS:
            fam = CounterMetricFamily(f"pdkv_nic_{name}", doc, labels=["model_name", "role", "nic"])
            for s in stats:
                fam.add_metric([*self.labels, s["name"]], s[field])
            yield fam
        qps = GaugeMetricFamily("pdkv_nic_queue_pairs", "Queue pairs on the NIC now (every connection's).",
                                labels=["model_name", "role", "nic"])
        for s in stats:
            qps.add_metric([*self.labels, s["name"]], s["qps"])
        yield qps


def register_nic_metrics(registry, messenger, model_name: str, role: str) -> NicMetrics:
    """Expose the messenger's per-NIC counts on a node's /metrics (``registry``)."""
    c = NicMetrics(messenger, model_name, role)
    registry.register(c)
    return c


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
