"""The shared KV hand-off (``disagg.kv_handoff: share``): the prefill node computes a request's
KV straight into the pages the decode node reserved, so no page is copied.

On the shm transport the decode node's granted pages are mapped in this process already; at the
request's first forward pass ``begin`` makes this node's own pages of the request those granted
pages (``Messenger.share_pages``: per layer, per run of pages consecutive on both sides), so the
attention reads and writes the decode node's pool through them. The page writes are queued as
always, at the same layer-counter points: the transport sees that each one's source already is
its destination and only sends its immediate, so the decode node's count and state machine do
not change. ``end`` (before the pages go back to this node's allocator) gives the pages their
own memory back; a revoke or a dropped connection does the same in the transport first.

What stays a copy: pages reused from this node's prefix cache (other requests hold them) and
the hidden-state row. Pages computed in borrowed memory are never published in this node's
prefix cache: their bytes are the decode node's once the request ends. A link whose layouts
differ (TP, page bytes) or whose pages are not whole OS pages uses the copy, logged once.

``auto`` (the default) shares where it can be asked for (``handoff``): the shm transport, host
memory, one rank, and no prefix cache on the prefill node, whose hits save compute where the
share saves only a copy (measured: docs/BENCHMARKS.md, "KV hand-off on one host").
"""

from __future__ import annotations

import logging
import os

import numpy as np

from pdkv.disagg.ratelog import RateLimitedLog

log = logging.getLogger(__name__)
_NEVER = 1 << 62  # num_published_pages that no page count reaches


def handoff(cfg) -> str:
    """The hand-off a prefill node of ``cfg`` uses: "share" or "copy" (``disagg.kv_handoff``;
    validated: an explicit share has what it needs)."""
    h = cfg.disagg.kv_handoff
    if h != "auto":
        return h
    ok = (cfg.messenger.transport in ("shm", "auto") and not str(cfg.model.device).startswith("cuda")
          and cfg.parallel.tp == 1 and not cfg.kv_cache.prefix_caching and cfg.messenger.staging != "cpu")
    return "share" if ok else "copy"


def page_runs(src: np.ndarray, dst: np.ndarray) -> list[tuple[int, int, int]]:
    """(src page, dst page, count) of the runs consecutive on both sides, in order."""
    runs: list[tuple[int, int, int]] = []
    for s, d in zip(src.tolist(), dst.tolist()):
        if runs and runs[-1][0] + runs[-1][2] == s and runs[-1][1] + runs[-1][2] == d:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((s, d, 1))
    return runs


class KVShare:
    def __init__(self, messenger, kv, page_size: int, explicit: bool = True):
        """``kv``: the node's pdkv.disagg.sharded.NodeKV (rank 0's region, registered);
        ``explicit``: share was asked for (a link that cannot is a warning, else info, once)."""
        self.m, self.kv, self.page_size, self.explicit = messenger, kv, page_size, explicit
        self._told: set[str] = set()
        self.src = kv.geometry
        self.os_page = os.sysconf("SC_PAGE_SIZE")
        self._rlog = RateLimitedLog(log)

    def why_not(self, link) -> str:
        """Why ``link`` cannot share pages ("" when it can)."""
        if self.m.transport == "auto":  # auto shares on the links it routed through shm
            via, why = self.m.route(link.conn)
            if via != "shm":
                return f"auto took {via} for this link ({why}; share needs shm)"
        elif self.m.transport != "shm":
            return f"transport {self.m.transport} (share needs shm)"
        if len(self.kv.keys) != 1 or len(link.kv_rkeys) != 1 or not isinstance(link.kv_rkeys[0], int):
            return "tensor parallelism on either side (the pages are cut between ranks)"
        pair_segs = link.plan.segments(0, 0)
        whole = len(pair_segs) == 1 and pair_segs[0].length == self.src.page_nbytes
        same = link.dst.page_nbytes == self.src.page_nbytes and link.dst.num_layers == self.src.num_layers
        if not whole or not same:
            return "the two nodes lay out a page differently"
        if self.src.page_nbytes % self.os_page or self.src.layer_nbytes % self.os_page:
            return (f"a KV page of {self.src.page_nbytes} bytes is not a whole number of "
                    f"{self.os_page}-byte OS pages (raise kv_cache.page_size)")
        return ""

    def begin(self, job, entry) -> None:
        """At ``job``'s first forward pass (``entry``: its pdkv.engine BatchEntry): its pages from
        the first one this node computes and the decode node lacks, shared; any failure leaves
        the job on the copy (what was shared is given back)."""
        job.shared = []
        why = self.why_not(job.link)
        if why:
            if why not in self._told and len(self._told) < 16:
                self._told.add(why)
                (log.warning if self.explicit else log.info)("prefill: kv_handoff share: copying instead on a "
                                                             "link where %s", why)
            return
        req = entry.request
        req.num_published_pages = _NEVER  # borrowed pages never enter this node's prefix cache
        first = max(job.skip, req.num_cached_tokens // self.page_size)
        pages = np.asarray(entry.page_ids, dtype=np.int64)
        if first >= len(pages):
            return
        src, dst = pages[first:], job.dst_pages[first - job.skip:len(pages) - job.skip]
        lkey, rkey = self.kv.keys[0], job.link.kv_rkeys[0]
        keys = job.dst_keys  # the request's grant key: on auto it names the transport that granted it
        if keys is not None and keys.uniform:
            rkey = keys.keys[0][0][0]
        g, d = self.src, job.link.dst
        try:
            for layer in range(g.num_layers):
                for s, t, n in page_runs(src, dst):
                    loff, ln = layer * g.layer_nbytes + s * g.page_nbytes, n * g.page_nbytes
                    roff = layer * d.layer_nbytes + t * d.page_nbytes
                    self.m.share_pages(job.link.conn, lkey, loff, rkey, roff, ln)
                    job.shared.append((loff, ln))
        except Exception as e:  # noqa: BLE001 - e.g. the grant was revoked meanwhile
            self._rlog.warning("share_failed", "prefill: sharing the pages of %s failed, copying: %s",
                               job.key, e)
            self.end(job)

    def end(self, job) -> None:
        """Before ``job``'s pages go back: they are this node's own memory again."""
        shared, job.shared = job.shared or [], []
        lkey = self.kv.keys[0] if self.kv.keys else 0
        for loff, ln in shared:
            try:
                self.m.unshare_pages(job.link.conn, lkey, loff, ln)
            except Exception as e:  # noqa: BLE001 - the connection is gone: the transport did it
                log.debug("prefill: unshare of %s: %s", job.key, e)
