"""NIXL (UCX backend, UCX_TLS=tcp) over loopback, for `pdkv.bench transfer`'s comparison.

Standalone: run by any Python where nixl is importable (it need not be pdkv's venv):
    python _cmp_nixl.py SIZES_CSV SECONDS  -> prints one JSON line {size: [GB/s, writes/s]}
NIXL may crash at interpreter exit after the work is done, so every process ends in os._exit.
"""
import json
import multiprocessing as mp
import os
import sys
import time

os.environ.setdefault("UCX_TLS", "tcp")
os.environ.setdefault("UCX_NET_DEVICES", "lo")
REGION = 64 << 20


def _target(conn) -> None:
    import numpy as np
    from nixl._api import nixl_agent, nixl_agent_config

    agent = nixl_agent("target", nixl_agent_config(backends=["UCX"]))
    buf = np.zeros(REGION, dtype=np.uint8)
    agent.register_memory([(buf.ctypes.data, REGION, 0, "")], "DRAM")
    conn.send((agent.get_agent_metadata(), buf.ctypes.data))
    conn.recv()  # the initiator is finished
    conn.send("bye")
    os._exit(0)


def main(sizes, seconds) -> dict:
    import numpy as np
    from nixl._api import nixl_agent, nixl_agent_config

    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_target, args=(child,))
    proc.start()
    meta, raddr = parent.recv()
    agent = nixl_agent("initiator", nixl_agent_config(backends=["UCX"]))
    src = np.ones(REGION, dtype=np.uint8)
    agent.register_memory([(src.ctypes.data, REGION, 0, "")], "DRAM")
    remote = agent.add_remote_agent(meta)
    out = {}
    for size in sizes:
        pages = REGION // size
        want = int(min(max(2e9 * seconds / size, 64), 400_000))
        idx = np.arange(min(pages, want), dtype=np.uint64) * size
        local = agent.get_xfer_descs(np.stack([src.ctypes.data + idx, np.full_like(idx, size), np.zeros_like(idx)], 1), "DRAM")
        rem = agent.get_xfer_descs(np.stack([raddr + idx, np.full_like(idx, size), np.zeros_like(idx)], 1), "DRAM")
        h = agent.initialize_xfer("WRITE", local, rem, remote)
        reps = max(1, want // len(idx))
        t0 = time.perf_counter()
        for _ in range(reps):
            state = agent.transfer(h)
            while state == "PROC":
                state = agent.check_xfer_state(h)
            if state != "DONE":
                raise RuntimeError(f"nixl transfer failed at {size} bytes")
        dt = time.perf_counter() - t0
        n = reps * len(idx)
        out[size] = [n * size / dt / 1e9, n / dt]
        agent.release_xfer_handle(h)
    parent.send("done")
    parent.recv()
    proc.join(10)
    return out


if __name__ == "__main__":
    res = main([int(s) for s in sys.argv[1].split(",")], float(sys.argv[2]))
    print(json.dumps(res), flush=True)
    os._exit(0)
