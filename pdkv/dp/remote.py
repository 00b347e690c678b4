"""A data-parallel group as a disaggregated decode node's engine: each rank's KV pool is
memory the group's front maps too, so the front's messenger registers every rank's pool as one
region and a prefill node writes a request's latent pages straight into the pool of the one
rank that decodes it.

Rank side (``python -m pdkv.dp.rank``): the KV cache lives in a shared-memory file the rank
creates (``shared_kv_buffer``; unlinked once the front mapped it, as pdkv/kv/shm.py does for TP
ranks), and the engine's connector is a ``RankRemoteConnector``: a request the front marked
remote is admitted with its uncached prompt pages reserved and pinned (WAITING_FOR_REMOTE_KV),
and the pages it reserved go back to the front in the rank's next reply (``take_reserved``).

Front side: ``RankPools`` maps every rank's file and builds a KVCache view over each (what
pdkv/disagg/sharded.py ``NodeKV`` registers, one region per DP rank). The decode coordinator
then grants a request's ranges on its rank's region only (pdkv/disagg/decode_memory.py).
GPU ranks would export their cache as cuMem the way TP followers do (pdkv/tp/worker.py); that
is not built: a GPU group is refused by name at start.

A prefill group's rank (``RankPrefillConnector``) computes each prompt's KV into its pool as
a prefill-only request; it also bumps a layer counter in a second shared file, after each
layer and once more when the forward returned, so the front's messenger, which watches every
rank's counter, posts a layer's page writes as soon as that rank passed it. Before each forward
it tells the front the forward's prefill chunks (``RankChunks``: which pages of which request,
from which counter value), and after it each finished prompt's last hidden row
(``RankHidden``); both go as ("note", ...) on the rank's channel ahead of the step's reply, in
order, so the front has queued every write of a chunk before it hears the prompt is done
(pdkv/disagg/dp_prefill.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from pdkv.engine.connector import LOCAL, RESERVE, Admission, KVConnector

COUNTER_NBYTES = 64  # a rank's layer counter: one int64 on its own cache line


class RankRemoteConnector(KVConnector):
    """The rank engine's connector on a disaggregated decode group (engine thread of the rank)."""

    def __init__(self, page_size: int):
        self.page_size = page_size
        self.remote: set[str] = set()  # marked remote by the front, not admitted yet
        self._reserved: list[tuple[str, int, list[int], int]] = []  # (rid, cached, pages after them, priority)

    def admission(self, req):
        if req.request_id not in self.remote or req.num_prompt_tokens <= 1:
            return LOCAL
        cached = req.num_cached_tokens  # whole pages this rank's prefix cache holds
        if cached >= req.num_prompt_tokens - 1:  # every page before the last token is here
            self.remote.discard(req.request_id)
            return LOCAL
        return Admission(num_external_tokens=req.num_prompt_tokens - 1 - cached, reuse_cached=True)

    def admit(self, req):
        if req.num_external_tokens:
            self.remote.discard(req.request_id)
            cached = req.num_cached_tokens
            self._reserved.append((req.request_id, cached, list(req.pages[cached // self.page_size:]),
                                   req.priority))
        return RESERVE

    def finished(self, req) -> None:
        self.remote.discard(req.request_id)

    def take_reserved(self) -> list[tuple[str, int, list[int], int]]:
        out, self._reserved = self._reserved, []
        return out


@dataclass(frozen=True)
class ChunkEntry:
    """One prefill chunk of a rank's forward, as pdkv/disagg/writes.py plan_batch reads a
    BatchEntry (``request`` is the entry itself: it carries the one field read of it)."""

    request_id: str
    start: int
    num_tokens: int
    is_last_chunk: bool
    num_cached_tokens: int
    page_ids: tuple[int, ...]
    prefill_only = True

    @property
    def request(self) -> ChunkEntry:
        return self


@dataclass(frozen=True)
class RankChunks:
    """Rank → front before a forward: its prefill chunks; the counter stood at ``base``."""

    base: int
    entries: tuple[ChunkEntry, ...]


@dataclass(frozen=True)
class RankHidden:
    """Rank → front after a forward: each finished prompt's last hidden row ``[H]``."""

    t_end: float  # time.time() when the forward returned (DONE_AT's t_end)
    rows: tuple[tuple[str, object], ...]


class RankPrefillConnector(KVConnector):
    """The rank engine's connector on a disaggregated prefill group (the rank's one thread).
    Every request is prefill-only and reuses this rank's cached prefix; the pages are held
    after the last chunk until the front's writes of them are done (``release``)."""

    ADMISSION = Admission(prefill_only=True, reuse_cached=True)

    def __init__(self, channel, keep: list, num_layers: int):
        from pdkv.gpu.layer_counter import CpuLayerCounter  # noqa: PLC0415
        from pdkv.kv.shm import SharedBuffer  # noqa: PLC0415

        self.channel, self.num_layers = channel, num_layers
        buf = SharedBuffer.create(COUNTER_NBYTES, "dp-counter")
        keep.append(buf)  # after the pool: pool_info names it, the front maps it, pool_mapped unlinks it
        self.counter = CpuLayerCounter(buf.address)
        self._issued = 0  # bumps issued so far: the base of the next forward's targets
        self._step_end = 0

    def admission(self, req):
        return self.ADMISSION

    def after_layer(self, layer: int | None = None) -> None:
        self._issued += 1
        self.counter.bump()

    def before_forward(self, batch) -> None:
        # every forward ends at base + L + 1 (the front queues layer-wise at base + l + 1, else
        # at base + L + 1), so either mode of messenger.layerwise works without the rank knowing
        self._step_end = self._issued + self.num_layers + 1
        entries = tuple(ChunkEntry(e.request_id, e.start, e.num_tokens, e.is_last_chunk,
                                   e.request.num_cached_tokens, tuple(e.page_ids))
                        for e in batch.entries if e.prefill_only)
        if entries:
            self.channel.send("note", RankChunks(self._issued, entries))

    def after_forward(self, batch, hidden) -> None:
        import time  # noqa: PLC0415

        t_end = time.time()
        while self._issued < self._step_end:  # the end-of-forward bump (or, failed: the rest)
            self.after_layer()
        if hidden is None:
            return
        # NOTE: clone: a pickled view would carry the whole [T, H] storage
        rows = tuple((e.request_id, hidden[e.row + e.num_tokens - 1].clone()) for e in batch.entries
                     if e.prefill_only and e.is_last_chunk)
        if rows:
            self.channel.send("note", RankHidden(t_end, rows))


def shared_kv_buffer(keep: list):
    """For LLMEngine(kv_buffer=...): the cache in a new shared-memory file (kept in ``keep``)."""
    from pdkv.kv.shm import SharedBuffer  # noqa: PLC0415

    def make(nbytes: int):
        buf = SharedBuffer.create(nbytes, "dp-kv")
        keep.append(buf)
        return buf.tensor()
    return make


def pool_info(engine, keep: list) -> dict:
    """What the front maps a rank's pool by (its file, size and cache shape)."""
    kv = engine.kv
    return {"path": str(keep[0].path), "nbytes": keep[0].nbytes, "num_layers": kv.num_layers,
            "num_pages": kv.num_pages, "page_size": kv.page_size, "layout": kv.layout,
            "dtype": str(kv.dtype).removeprefix("torch."), "kv_scales": [list(s) for s in kv.kv_scales or []],
            "counter": str(keep[1].path) if len(keep) > 1 else None}  # a prefill rank's layer counter


@dataclass(frozen=True)
class PoolRegion:
    """One DP rank's KV pool as the front sees it (the fields of pdkv.tp.KVRegion)."""

    rank: int
    address: int
    nbytes: int
    device: str
    kv_heads: tuple[int, ...]
    cache: object


class RankPools:
    """The front's mapping of every rank's KV pool: ``regions`` by rank, ``kv`` rank 0's view
    (every rank's pool has the same geometry: same model, same kv_cache section); a prefill
    group's: ``counters``, each rank's layer counter's address here (else empty)."""

    def __init__(self, arch, infos: list[dict]):
        import torch  # noqa: PLC0415

        from pdkv.kv.shm import SharedBuffer  # noqa: PLC0415
        from pdkv.models.kv_layout import kv_layout  # noqa: PLC0415

        lay = kv_layout(arch)
        self.buffers = [SharedBuffer.attach(i["path"], i["nbytes"]) for i in infos]
        self.regions: list[PoolRegion] = []
        for r, (info, buf) in enumerate(zip(infos, self.buffers)):
            cache = lay.make_cache(info["num_layers"], info["num_pages"], info["page_size"],
                                   getattr(torch, info["dtype"]), info["layout"], "cpu", buffer=buf.tensor())
            cache.kv_scales = [tuple(s) for s in info["kv_scales"]] or None
            self.regions.append(PoolRegion(r, buf.address, buf.nbytes, "cpu", tuple(range(cache.num_kv_heads)),
                                           cache))
        self.kv = self.regions[0].cache
        self.buffers += [SharedBuffer.attach(i["counter"], COUNTER_NBYTES) for i in infos if i.get("counter")]
        self.counters = [b.address for b in self.buffers[len(infos):]]
