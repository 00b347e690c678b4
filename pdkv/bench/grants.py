"""`python -m pdkv.bench grants`: what narrow grants cost the decode node per request.

A request's grants (pdkv/disagg/grants.py) are one range per (KV rank, layer, run of consecutive
pages) plus its hidden row; on verbs each range is an MR registered in the prefill peer's
protection domain at PREFILL and deregistered when the request ends. This times grant + revoke
of one request (the messenger calls the decode node makes, nothing else) for pages coalesced
into 1 run (contiguous) up to one run per page (fully fragmented: what registering page by page
would cost), in the same run, and prints per-request and per-range microseconds and the ratio
to the contiguous case.

    python -m pdkv.bench grants [--transport tcp|verbs] [--nic NAME] [--layers 32] [--ranks 1]
                                [--pages 16] [--page-kib 16] [--pool 256] [--repeat 50]

verbs here: the loopback device (LD_LIBRARY_PATH=.cache/verbs_loopback/<hash>, --nic lo_verbs0)
costs a user-space table insert; a real NIC's ibv_reg_mr is a system call plus a device command
(and dereg the same), typically tens of microseconds each — measure there with --nic mlx5_0.
"""
from __future__ import annotations

import argparse
import time

import numpy as np

from pdkv.disagg.grants import RequestGrants
from pdkv.disagg.writes import Geometry


def pages_with_runs(num_pages: int, runs: int) -> list[int]:
    """``num_pages`` page ids forming exactly ``runs`` runs (gaps of one page between them)."""
    sizes = [num_pages // runs + (1 if i < num_pages % runs else 0) for i in range(runs)]
    out, p = [], 0
    for n in sizes:
        out += list(range(p, p + n))
        p += n + 1
    return out


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="python -m pdkv.bench grants")
    ap.add_argument("--transport", default="tcp", choices=("tcp", "verbs"))
    ap.add_argument("--nic", default=None)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--ranks", type=int, default=1, help="decode KV ranks (one region each)")
    ap.add_argument("--pages", type=int, default=16, help="pages per request")
    ap.add_argument("--page-kib", type=int, default=16, help="one page of one layer, KiB")
    ap.add_argument("--pool", type=int, default=256, help="pages per layer in each region")
    ap.add_argument("--repeat", type=int, default=50)
    ap.add_argument("--held", type=int, default=0,
                    help="requests (one page each, at the pool's end) the peer holds meanwhile: lookups scale with them")
    a = ap.parse_args(argv)
    from pdkv._messenger import Messenger

    from pdkv.transports import VerbsOptions

    opts = VerbsOptions(nics=(a.nic,), isolate_peers=True) if a.transport == "verbs" else None
    if a.transport == "verbs" and not a.nic:
        raise SystemExit("--transport verbs needs --nic NAME (lo_verbs0 for the loopback device)")
    m = Messenger(a.transport, 1, opts)
    page = a.page_kib << 10
    geo = Geometry(a.layers, page, a.pool * page)
    bufs = [np.empty(a.layers * geo.layer_nbytes, dtype=np.uint8) for _ in range(a.ranks)]
    hidden = np.empty((a.held + 32) * 256, dtype=np.uint8)  # rows of 256 bytes
    grants = RequestGrants(m, [m.register(b) for b in bufs], geo, m.register(hidden), 256)
    grants.revoke(2, grants.grant(2, [0], 0))  # warm-up: the peer's protection domain exists
    if a.held + 2 * a.pages > a.pool:
        raise SystemExit(f"--held {a.held} + 2 x --pages {a.pages} must fit in --pool {a.pool}")
    held = [grants.grant(2, [a.pool - 1 - i], 16 + i) for i in range(a.held)]
    print(f"transport {a.transport}{' ' + a.nic if a.transport == 'verbs' else ''}: {a.ranks} rank(s) x {a.layers} layers, "
          f"{a.pages} pages of {a.page_kib} KiB per request, {a.repeat} requests each; the peer holds "
          f"{sum(len(h) for h in held)} other ranges")
    print(f"{'runs':>5} {'ranges':>7} {'grant us':>10} {'revoke us':>10} {'us/range':>9} {'vs 1 run':>9}")
    base = None
    for runs in sorted({1, 2, 4, a.pages}):
        if runs > a.pages:
            continue
        pages = pages_with_runs(a.pages, runs)
        t_grant = t_revoke = 0.0
        for i in range(a.repeat):
            t0 = time.perf_counter()
            got = grants.grant(2, pages, i % 16)
            t1 = time.perf_counter()
            assert not grants.revoke(2, got)
            t_revoke += time.perf_counter() - t1
            t_grant += t1 - t0
        n = grants.count(pages)
        per_req = (t_grant + t_revoke) / a.repeat * 1e6
        base = base or per_req
        print(f"{runs:>5} {n:>7} {t_grant / a.repeat * 1e6:>10.1f} {t_revoke / a.repeat * 1e6:>10.1f} "
              f"{per_req / n:>9.2f} {per_req / base:>8.1f}x")
    for h in held:
        grants.revoke(2, h)
    m.close()
    return 0
