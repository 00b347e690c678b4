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
is not built: a GPU decode group is refused by name at start.
"""

from __future__ import annotations

from dataclasses import dataclass

from pdkv.engine.connector import LOCAL, RESERVE, Admission, KVConnector


class RankRemoteConnector(KVConnector):
    """The rank engine's connector on a disaggregated decode group (engine thread of the rank)."""

    def __init__(self, page_size: int):
        self.page_size = page_size
        self.remote: set[str] = set()  # marked remote by the front, not admitted yet
        self._reserved: list[tuple[str, int, list[int]]] = []  # (rid, cached tokens, pages after them)

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
            self._reserved.append((req.request_id, cached, list(req.pages[cached // self.page_size:])))
        return RESERVE

    def finished(self, req) -> None:
        self.remote.discard(req.request_id)

    def take_reserved(self) -> list[tuple[str, int, list[int]]]:
        out, self._reserved = self._reserved, []
        return out


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
            "dtype": str(kv.dtype).removeprefix("torch."), "kv_scales": [list(s) for s in kv.kv_scales or []]}


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
    (every rank's pool has the same geometry: same model, same kv_cache section)."""

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
