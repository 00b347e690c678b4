"""`python -m pdkv.bench transfer`: page writes between two processes over loopback.

For each page size it measures, in the same run:
  pdkv     the messenger's transport (tcp by default): page batches with one immediate, timed
           from the first post until the receiver's imm_done (so every byte has landed);
  raw-1    a plain socket pair, sendall() of page-sized chunks / recv_into a preallocated buffer;
  raw-N    the same over N sockets (N = the transport's stream count), one thread per socket,
           twice: "hot" into one 4 MiB buffer per socket (the bytes stay in the caches), and
           "pool" into a 256 MiB region, as pages land in a KV pool: the target's baseline;
  memcpy   numpy copy bandwidth of the same bytes (the ceiling of any in-memory transfer);
  nixl / mooncake  when importable (optional; skipped with a message otherwise).
Numbers are GB/s (1e9 bytes/s) and writes/s; `ratio` is pdkv / raw-N pool, `/hot` pdkv / raw-N
hot. ``--transport libfabric`` also measures the tcp transport in the same run and prints
libfabric / tcp per page size.

    python -m pdkv.bench transfer [--sizes 4K,16K,...] [--streams 2] [--seconds 0.5]
                                  [--transport libfabric --provider P [--domain D]]
                                  [--peers-python /path/to/venv/bin/python] [--no-peers]
                                  [--staged [--device auto|cpu|cuda]]

``--staged`` adds the staging pipeline of the disaggregated roles (pdkv/bench/_staged.py: device
buffer -> copy engine -> ring -> transport -> ring -> copy engine -> device buffer; CPU copy engine
on host memory, CUDA copies on a GPU) and its ratio to ``pdkv`` (host memory moved directly).
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import select
import socket
import sys
import threading
import time

import numpy as np

SIZES = "4K,16K,64K,256K,1M,4M"
REGION = 64 << 20  # bytes registered on each side; pages wrap around inside it
# The raw sockets' honest baseline receives into a pool this large, as a decode node's KV pool is:
# into one cache-hot 4 MiB buffer per socket they swung 4.6-8.4 GB/s between runs on 2 cores.
RAW_POOL = 256 << 20


def parse_size(s: str) -> int:
    s = s.strip().upper()
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(s[-1:], 1)
    return int(s[:-1] if s[-1:] in "KMG" else s) * mult


def num_writes(size: int, seconds: float) -> int:
    """Writes per measurement: about `seconds` at 2 GB/s, at least 64, at most 400k."""
    return int(min(max(2e9 * seconds / size, 64), 400_000))


# ---- pdkv ----

def _transport_options(transport: str, streams: int, nic: str | None, provider: str = "auto",
                      domain: str | None = None):
    """The transport options of one bench endpoint (pdkv.transports): tcp streams, the verbs NIC
    (both ends use it), or the libfabric provider and domain (default for tcp-based providers:
    the loopback interface)."""
    from pdkv import transports

    if transport == "libfabric":
        dom = domain if domain is not None else ("" if provider in ("shm", "efa", "auto") else "lo")
        return transports.LibfabricOptions(provider=provider, domains=(dom,) if dom else ())
    if transport == "verbs":
        if not nic:
            raise SystemExit("--transport verbs needs --nic NAME (an RDMA device, e.g. mlx5_0; `ibv_devices` lists them)")
        return transports.VerbsOptions(nics=(nic,))
    if transport == "tcp":
        return transports.TcpOptions(num_streams=streams)
    return transports.options_class(transport)()


def _pdkv_receiver(conn, transport: str, opts, data_key: bytes | None = None) -> None:
    from pdkv._messenger import Messenger

    m = Messenger(transport, 2, opts)
    dst = np.zeros(REGION, dtype=np.uint8)
    key = m.register(dst)
    m.grant(key, 1)
    c, info = m.prepare(1, data_key=data_key)
    conn.send((key, info))
    m.complete(c, conn.recv())
    conn.send("ready")
    while True:
        msg = conn.recv()
        if msg is None:
            break
        imm, count = msg
        m.expect(imm, count)
        conn.send("expecting")
        done = None
        while done is None:
            select.select([m.fileno()], [], [], 1.0)
            for ev in m.drain():
                if ev.kind == "imm_done" and ev.imm == imm:
                    done = ev
                elif ev.kind == "error":
                    done = ev
        conn.send((done.kind, done.count, done.reason))
    m.close()
    conn.send("bye")


def bench_pdkv(sizes: list[int], seconds: float, transport: str, streams: int,
               nic: str | None = None, data_key: bytes | None = None,
               **fabric) -> dict[int, tuple[float, float]]:
    """``data_key``: tcp streams sealed with it (messenger.tls_data) at both ends."""
    from pdkv._messenger import Messenger

    opts = _transport_options(transport, streams, nic, **fabric)
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_pdkv_receiver, args=(child, transport, opts, data_key), daemon=True)
    proc.start()
    m = Messenger(transport, 1, opts)
    src = np.random.default_rng(0).integers(0, 255, REGION, dtype=np.uint8)
    lkey = m.register(src)
    rkey, rinfo = parent.recv()
    c, info = m.prepare(2, data_key=data_key)
    m.complete(c, rinfo)
    parent.send(info)
    assert parent.recv() == "ready"
    out = {}
    for imm, size in enumerate(sizes, start=1):
        n = num_writes(size, seconds)
        pages = np.arange(n, dtype=np.int64) % (REGION // size)
        parent.send((imm, n))
        assert parent.recv() == "expecting"
        t0 = time.perf_counter()
        step = 8192
        for i in range(0, n, step):
            m.write_pages(c, lkey, rkey, pages[i:i + step], pages[i:i + step], seg_len=size,
                          src_page_stride=size, dst_page_stride=size, imm=imm, tag=imm)
        kind, count, reason = parent.recv()
        dt = time.perf_counter() - t0
        if kind != "imm_done":
            raise RuntimeError(f"pdkv transfer of {size}-byte pages failed: {reason}")
        m.drain()
        out[size] = (n * size / dt / 1e9, n / dt)
    parent.send(None)
    parent.recv()
    proc.join(10)
    m.close()
    return out


# ---- raw sockets ----

def _raw_receiver(conn, streams: int, region: int) -> None:
    """``region`` 0: each socket receives into its own 4 MiB buffer, over and over (cache-hot:
    the bytes never leave the caches); else every socket writes on through its share of one
    ``region``-byte pool, wrapping at its end, as pages land in a KV pool far larger than the
    caches."""
    ls = socket.socket()
    ls.bind(("127.0.0.1", 0))
    ls.listen(streams)
    conn.send(ls.getsockname()[1])
    socks = [ls.accept()[0] for _ in range(streams)]
    chunk = 4 << 20
    if region:
        pool = memoryview(bytearray(region))
        share = region // streams
        bufs = [pool[i * share:(i + 1) * share] for i in range(streams)]
        ones = b"\x01" * chunk
        for off in range(0, region, chunk):  # touched once: page faults are not the receive's cost
            pool[off:off + chunk] = ones[:min(chunk, region - off)]
    else:
        bufs = [memoryview(bytearray(chunk)) for _ in socks]
    at = [0] * streams  # where in its buffer each socket writes next
    while True:
        total = conn.recv()
        if total is None:
            break
        got = [0] * streams

        def rx(i: int, want: int) -> None:
            view = bufs[i]
            while got[i] < want:
                if at[i] == len(view):
                    at[i] = 0
                end = min(len(view), at[i] + chunk, at[i] + want - got[i])
                r = socks[i].recv_into(view[at[i]:end])
                if r == 0:
                    return
                got[i] += r
                at[i] = at[i] + r if region else 0

        ths = [threading.Thread(target=rx, args=(i, total[i])) for i in range(streams)]
        for t in ths:
            t.start()
        for t in ths:
            t.join()
        conn.send(sum(got))
    for s in socks:
        s.close()


def bench_raw(sizes: list[int], seconds: float, streams: int, region: int = 0) -> dict[int, tuple[float, float]]:
    """GB/s and writes/s of plain sockets per page size; ``region``: see _raw_receiver."""
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_raw_receiver, args=(child, streams, region), daemon=True)
    proc.start()
    port = _answer(parent, proc)
    socks = [socket.create_connection(("127.0.0.1", port)) for _ in range(streams)]
    src = np.random.default_rng(0).integers(0, 255, REGION, dtype=np.uint8)
    view = memoryview(src)
    out = {}
    for size in sizes:
        n = num_writes(size, seconds)
        per = [n // streams + (1 if i < n % streams else 0) for i in range(streams)]
        parent.send([p * size for p in per])
        wraps = REGION // size

        def tx(i: int) -> None:
            s = socks[i]
            for k in range(per[i]):
                off = (k % wraps) * size
                s.sendall(view[off:off + size])

        t0 = time.perf_counter()
        ths = [threading.Thread(target=tx, args=(i,)) for i in range(streams)]
        for t in ths:
            t.start()
        for t in ths:
            t.join()
        got = _answer(parent, proc)
        dt = time.perf_counter() - t0
        assert got == n * size, (got, n * size)
        out[size] = (n * size / dt / 1e9, n / dt)
    parent.send(None)
    proc.join(10)
    for s in socks:
        s.close()
    return out


def _answer(conn, proc):
    """The receiver's next message; an error, not a hang, when the receiver died first."""
    while not conn.poll(0.5):
        if not proc.is_alive():
            raise RuntimeError(f"the raw-socket receiver exited with code {proc.exitcode}")
    return conn.recv()


def bench_memcpy(nbytes: int = 64 << 20, reps: int = 10) -> float:
    a = np.ones(nbytes, dtype=np.uint8)
    b = np.empty_like(a)
    np.copyto(b, a)
    t0 = time.perf_counter()
    for _ in range(reps):
        np.copyto(b, a)
    return nbytes * reps / (time.perf_counter() - t0) / 1e9


# ---- optional peers ----

def bench_optional(name: str, sizes: list[int], seconds: float, python: str) -> dict[int, tuple[float, float]] | str:
    """NIXL / Mooncake over loopback tcp when importable by `python`; else why they were skipped."""
    from pdkv.bench import _peers

    return _peers.run(name, sizes, seconds, python)


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="python -m pdkv.bench transfer", description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default=SIZES, help=f"page sizes (default {SIZES})")
    ap.add_argument("--streams", type=int, default=2, help="tcp streams per peer (default 2)")
    ap.add_argument("--seconds", type=float, default=0.5, help="target seconds per measurement at 2 GB/s")
    ap.add_argument("--transport", default="tcp",
                    help="tcp (default), verbs, shm (same host) or libfabric (shm, libfabric: also tcp, same run)")
    ap.add_argument("--nic", default=None, help="verbs: the RDMA device both endpoints use (e.g. mlx5_0)")
    ap.add_argument("--provider", default="auto", help="libfabric: efa, tcp;ofi_rxm, sockets, shm, auto")
    ap.add_argument("--domain", default=None, help="libfabric: the fabric domain (default: lo for tcp-based providers)")
    ap.add_argument("--no-peers", action="store_true", help="skip NIXL / Mooncake even if installed")
    ap.add_argument("--staged", action="store_true", help="also measure the staging pipeline (copy engines, rings)")
    ap.add_argument("--rounds", type=int, default=3,
                    help="--staged / --tls-data: alternating rounds of both, best of each (default 3)")
    ap.add_argument("--tls-data", action="store_true",
                    help="tcp: also measure sealed streams (messenger.tls_data: AES-256-GCM records)")
    ap.add_argument("--device", default="auto", help="--staged: where the pages live: auto (cuda if available), cpu, cuda")
    ap.add_argument("--peers-python", default=os.environ.get("PDKV_PEERS_PYTHON", sys.executable),
                    help="interpreter that has nixl / mooncake installed (default: this one, or $PDKV_PEERS_PYTHON)")
    a = ap.parse_args(argv)
    sizes = [parse_size(s) for s in a.sizes.split(",")]
    print(f"pdkv transfer benchmark: {a.transport}, {a.streams} streams, loopback, {os.cpu_count()} CPUs")
    memcpy = bench_memcpy()
    if a.transport == "verbs":
        _transport_options(a.transport, a.streams, a.nic)  # a missing --nic fails before any work
    fabric = {"provider": a.provider, "domain": a.domain} if a.transport == "libfabric" else {}
    if fabric:
        print(f"libfabric provider {a.provider}, domain {list(_transport_options(a.transport, 0, None, **fabric).domains)}")
    pdkv = bench_pdkv(sizes, a.seconds, a.transport, a.streams, a.nic, **fabric)
    # libfabric: the tcp transport beside it, same run, same machine state
    over_tcp = bench_pdkv(sizes, a.seconds, "tcp", a.streams) if fabric or a.transport == "shm" else None
    if a.staged:
        from pdkv.bench._staged import _device, bench_staged

        # alternating rounds, best of each: on a busy machine one measurement each would compare
        # two different moments of the other load, not the two paths
        kw = _transport_options(a.transport, a.streams, a.nic, **fabric)
        staged = bench_staged(sizes, a.seconds, a.transport, kw, a.device, REGION, num_writes)
        for _ in range(a.rounds - 1):
            memcpy = max(memcpy, bench_memcpy())
            pdkv = _best(pdkv, bench_pdkv(sizes, a.seconds, a.transport, a.streams, a.nic, **fabric))
            staged = _best(staged, bench_staged(sizes, a.seconds, a.transport, kw, a.device, REGION, num_writes))
    sealed = None
    if a.tls_data:  # alternating rounds, best of each (the same reason as --staged)
        key = os.urandom(32)
        sealed = bench_pdkv(sizes, a.seconds, a.transport, a.streams, data_key=key)
        for _ in range(a.rounds - 1):
            pdkv = _best(pdkv, bench_pdkv(sizes, a.seconds, a.transport, a.streams))
            sealed = _best(sealed, bench_pdkv(sizes, a.seconds, a.transport, a.streams, data_key=key))
    raw1 = bench_raw(sizes, a.seconds, 1)
    hot = bench_raw(sizes, a.seconds, a.streams) if a.streams > 1 else raw1
    rawn = bench_raw(sizes, a.seconds, a.streams, RAW_POOL)  # the target's baseline
    peers = {} if a.no_peers else {p: bench_optional(p, sizes, a.seconds, a.peers_python) for p in ("nixl", "mooncake")}
    print(f"memcpy: {memcpy:.2f} GB/s")
    ok_peers = {p: r for p, r in peers.items() if isinstance(r, dict)}
    print(f"raw-N hot: each socket into one 4 MiB buffer (cache-hot); raw-N pool: into a "
          f"{RAW_POOL >> 20} MiB pool (the target's baseline); pdkv writes into {REGION >> 20} MiB")
    head = (f"{'page':>6} {'pdkv GB/s':>10} {'writes/s':>10} {'raw-1 GB/s':>11} {f'raw-{a.streams} hot':>11} "
            f"{'/hot':>5} {f'raw-{a.streams} pool':>12} {'ratio':>6}")
    for p in ok_peers:
        head += f" {p + ' GB/s':>14} {'pdkv/' + p:>13}"
    print(head)
    for s in sizes:
        g, w = pdkv[s]
        line = (f"{fmt(s):>6} {g:10.2f} {w:10.0f} {raw1[s][0]:11.2f} {hot[s][0]:11.2f} {g / hot[s][0]:5.2f} "
                f"{rawn[s][0]:12.2f} {g / rawn[s][0]:6.2f}")
        for p, r in ok_peers.items():
            line += f" {r[s][0]:14.2f} {g / r[s][0]:13.2f}" if s in r else f" {'-':>14} {'-':>13}"
        print(line)
    for p, r in peers.items():
        if p not in ok_peers:
            print(f"{p}: {r}")
    if over_tcp:
        print(f"{a.transport}{f' ({a.provider})' if fabric else ''} vs the tcp transport, same run:")
        print(f"{'page':>6} {a.transport + ' GB/s':>15} {'writes/s':>10} {'tcp GB/s':>9} {'writes/s':>10} {'ratio':>6}")
        for s in sizes:
            (g, w), (tg, tw) = pdkv[s], over_tcp[s]
            print(f"{fmt(s):>6} {g:15.2f} {w:10.0f} {tg:9.2f} {tw:10.0f} {g / tg:6.2f}")
    if a.transport == "shm":  # one memcpy per page into the granted mapping: memcpy is the ceiling
        print(f"{'page':>6} {'shm GB/s':>9} {'memcpy GB/s':>12} {'shm/memcpy':>11}")
        for s in sizes:
            print(f"{fmt(s):>6} {pdkv[s][0]:9.2f} {memcpy:12.2f} {pdkv[s][0] / memcpy:11.2f}")
        big = [pdkv[s][0] / memcpy for s in sizes if s >= 64 << 10]
        if big:
            print(f"target: shm >= 0.8 x memcpy at >= 64K: min ratio {min(big):.2f}")
    big = [pdkv[s][0] / rawn[s][0] for s in sizes if s >= 64 << 10]
    if big:
        print(f"target: pdkv >= 0.85 x raw-{a.streams} pool at >= 64K: min ratio {min(big):.2f}")
    if 4096 in pdkv:
        print(f"target: >= 100000 writes/s at 4K: {pdkv[4096][1]:.0f}")
    if sealed is not None:
        print(f"tls_data (sealed streams, AES-256-GCM both ends) vs plain, same run, best of {a.rounds} "
              "alternating rounds:")
        print(f"{'page':>6} {'plain GB/s':>11} {'sealed GB/s':>12} {'sealed/plain':>13}")
        for s in sizes:
            print(f"{fmt(s):>6} {pdkv[s][0]:11.2f} {sealed[s][0]:12.2f} {sealed[s][0] / pdkv[s][0]:13.2f}")
    if a.staged:
        print(f"staged ({_device(a.device)} KV, copy engines both ends) vs pdkv (host memory, direct), same run, "
              f"best of {a.rounds} alternating rounds:")
        # CPU copy engine: both copies are memcpys on the same cores the tcp loopback copies on,
        # so the staged pipeline cannot beat 1 / (1/pdkv + 2/memcpy) here (a GPU's DMA engines
        # copy without the CPU); "of bound" says how close to that it gets
        cpu = _device(a.device) == "cpu"
        print(f"{'page':>6} {'pdkv GB/s':>10} {'staged GB/s':>12} {'staged/pdkv':>12}"
              + (f" {'cpu bound':>10} {'of bound':>9}" if cpu else ""))
        for s in sizes:
            line = f"{fmt(s):>6} {pdkv[s][0]:10.2f} {staged[s][0]:12.2f} {staged[s][0] / pdkv[s][0]:12.2f}"
            if cpu:
                bound = 1 / (1 / pdkv[s][0] + 2 / memcpy)
                line += f" {bound:10.2f} {staged[s][0] / bound:9.2f}"
            print(line)
        big = [staged[s][0] / pdkv[s][0] for s in sizes if s >= 64 << 10]
        if big:
            print(f"target: staged >= 0.90 x pdkv at >= 64K: min ratio {min(big):.2f}")
    return 0


def _best(a: dict, b: dict) -> dict:
    return {s: max(a[s], b[s]) for s in a}


def fmt(n: int) -> str:
    return f"{n >> 20}M" if n >= 1 << 20 else f"{n >> 10}K"
