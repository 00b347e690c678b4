"""Mooncake's transfer engine (protocol tcp, P2PHANDSHAKE metadata) over loopback, for
`pdkv.bench transfer`'s comparison.

Standalone: run by any Python where mooncake.engine is importable:
    python _cmp_mooncake.py SIZES_CSV SECONDS  -> prints one JSON line {size: [GB/s, writes/s]}
"""
import json
import multiprocessing as mp
import os
import sys
import time

REGION = 64 << 20


def _engine():
    from mooncake.engine import TransferEngine

    e = TransferEngine()
    rc = e.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "")
    if rc != 0:
        raise RuntimeError(f"mooncake initialize failed: {rc}")
    return e


def _target(conn) -> None:
    import numpy as np

    e = _engine()
    buf = np.zeros(REGION, dtype=np.uint8)
    assert e.register_memory(buf.ctypes.data, REGION) == 0
    conn.send((f"127.0.0.1:{e.get_rpc_port()}", buf.ctypes.data))
    conn.recv()
    conn.send("bye")
    os._exit(0)


def main(sizes, seconds) -> dict:
    import numpy as np

    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_target, args=(child,))
    proc.start()
    session, raddr = parent.recv()
    e = _engine()
    src = np.ones(REGION, dtype=np.uint8)
    assert e.register_memory(src.ctypes.data, REGION) == 0
    out = {}
    for size in sizes:
        pages = REGION // size
        want = int(min(max(2e9 * seconds / size, 64), 400_000))
        n1 = min(pages, want, 1024)  # writes per batch call (larger batches fail with -1)
        offs = [i * size for i in range(n1)]
        local = [src.ctypes.data + o for o in offs]
        remote = [raddr + o for o in offs]
        lens = [size] * n1
        reps = max(1, want // n1)
        t0 = time.perf_counter()
        for _ in range(reps):
            rc = e.batch_transfer_sync_write(session, local, remote, lens)
            if rc != 0:
                raise RuntimeError(f"mooncake transfer failed at {size} bytes: {rc}")
        dt = time.perf_counter() - t0
        out[size] = [reps * n1 * size / dt / 1e9, reps * n1 / dt]
    parent.send("done")
    parent.recv()
    proc.join(10)
    return out


if __name__ == "__main__":
    res = main([int(s) for s in sys.argv[1].split(",")], float(sys.argv[2]))
    print(json.dumps(res), flush=True)
    os._exit(0)
