"""A messenger endpoint in its own process, driven by the test over a pipe (msgpack RPC).

Every transport test runs its two endpoints as children of the test, so one test body serves
tcp and verbs alike: the verbs children get LD_LIBRARY_PATH pointing at the loopback
libibverbs.so.1, which is never loaded into the pytest process itself.

Run as `python peer.py`; requests on stdin, replies on a dup of stdout (fd 1 itself is pointed
at stderr so that nothing else can corrupt the reply stream).
"""
from __future__ import annotations

import dataclasses
import os
import select
import sys
import time

import msgpack
import numpy as np

from pdkv._messenger import Messenger  # loaded before the baseline is taken
from pdkv.transports import OPTIONS, options_class

GUARD = 4096  # guard bytes on each side of every buffer
GUARD_BYTE = 0xA5


POLLER_KWARGS = ("spin_us", "yield_us", "sleep_us", "cpus")


class Agent:
    def __init__(self) -> None:
        self.m = None
        self.bufs: dict[str, np.ndarray] = {}  # name -> guard + region + guard
        self.counters: dict[str, np.ndarray] = {}
        self.events: list = []
        self.baseline = self.resources()  # threads / fds before any messenger exists

    # -- setup --
    def create(self, transport: str, node_id: int, kwargs: dict) -> None:
        # the poller's settings are the Messenger's; the rest are the transport's own options
        poller = {k: kwargs.pop(k) for k in POLLER_KWARGS if k in kwargs}
        # (a test's tcp setting such as num_streams means nothing to the other transports)
        cls = options_class(transport)
        names = {f.name for f in dataclasses.fields(cls)}
        known = {f.name for c in OPTIONS.values() for f in dataclasses.fields(c)}
        if set(kwargs) - known:  # a typo is an error, never dropped
            raise TypeError(f"no transport takes {sorted(set(kwargs) - known)}")
        opts = {k: tuple(v) if isinstance(v, list) else v for k, v in kwargs.items() if k in names}
        self.m = Messenger(transport, node_id, cls(**opts), **poller)

    def alloc(self, name: str, size: int, seed: int | None = None) -> None:
        raw = np.full(size + 2 * GUARD, GUARD_BYTE, dtype=np.uint8)
        region = raw[GUARD:GUARD + size]
        region[:] = 0 if seed is None else np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8)
        self.bufs[name] = raw

    def region(self, name: str) -> np.ndarray:
        raw = self.bufs[name]
        if name in getattr(self, "memfds", {}):
            return raw
        return raw[GUARD:len(raw) - GUARD]

    def register(self, name: str) -> int:
        return self.m.register(self.region(name))

    def read(self, name: str, off: int = 0, length: int | None = None) -> bytes:
        r = self.region(name)
        return r[off:len(r) if length is None else off + length].tobytes()

    def fill(self, name: str, seed: int) -> None:
        r = self.region(name)
        r[:] = np.random.default_rng(seed).integers(0, 256, len(r), dtype=np.uint8)

    def guards_ok(self, name: str) -> bool:
        raw = self.bufs[name]
        return bool((raw[:GUARD] == GUARD_BYTE).all() and (raw[-GUARD:] == GUARD_BYTE).all())

    def call(self, method: str, args: list, kwargs: dict):
        return getattr(self.m, method)(*args, **kwargs)

    # -- counters --
    def counter(self, name: str) -> int:
        self.counters[name] = np.zeros(1, dtype=np.int64)
        return self.m.watch(self.counters[name])

    def bump(self, name: str, value: int) -> None:
        self.counters[name][0] = value

    def poller_under_gil(self, name: str, value: int, batches_before: int) -> dict:
        """Hold the GIL in a busy Python loop (switch interval 100 s, so no other Python thread
        could run), move the counter, and watch the C poller post the batch anyway.

        A canary Python thread counts while it can run: its count before the store and after
        the post are returned, so the caller can check that the GIL was never handed over (not
        even inside a call of the loop) while the poller posted."""
        import threading

        m, ctr = self.m, self.counters[name]
        ticks, stop = [0], [False]

        def canary():
            while not stop[0]:
                ticks[0] += 1
                time.sleep(0)  # hand the GIL back at once: a handover shows as a tick, not a hang

        bird = threading.Thread(target=canary, daemon=True)
        bird.start()
        while ticks[0] < 1000:  # it runs: the GIL is shared normally before the window
            time.sleep(0.001)
        old = sys.getswitchinterval()
        sys.setswitchinterval(100.0)
        try:
            # A thread already waiting for the GIL keeps the interval it read when it began to
            # wait, and asks for the GIL after it: let the canary start two fresh waits first.
            mark = ticks[0]
            while ticks[0] < mark + 2:
                time.sleep(0.001)
            polls_before = m.polls()
            ticks_before = ticks[0]
            ctr[0] = value  # the "layer done" store, made while this thread holds the GIL
            deadline = time.perf_counter() + 20.0
            spins = 0
            while m.stats()["posted_batches"] <= batches_before and time.perf_counter() < deadline:
                spins += 1  # pure Python: the GIL is never released in here
            s = m.stats()
            ticks_after = ticks[0]
        finally:
            sys.setswitchinterval(old)
            stop[0] = True
        bird.join(10)
        return {"posted": s["posted_batches"] > batches_before, "polls_before": polls_before,
                "post_poll": s["last_post_poll"], "spins": spins, "canary_before": ticks_before,
                "canary_after": ticks_after, "canary_alive": bird.is_alive()}

    def wait_stat(self, name: str, at_least: int, timeout: float = 30.0) -> int:
        """Poll stats()[name] until it reaches at_least (or timeout, a hang guard); returns it."""
        deadline = time.monotonic() + timeout
        while self.m.stats()[name] < at_least and time.monotonic() < deadline:
            time.sleep(0.002)
        return self.m.stats()[name]

    # -- results --
    def wait(self, kind: str | None = None, count: int = 1, timeout: float = 10.0, imm: int | None = None) -> list:
        """Drain events until `count` of `kind` (and imm; kind "failed": any failure) were seen or timeout; returns all
        events drained since the last wait(), as tuples."""
        deadline = time.monotonic() + timeout

        def hit(e) -> bool:
            if kind == "failed":  # a failure in any form: error event, or a batch with failed writes
                return e[0] == "error" or (e[0] == "batch_done" and e[6] > 0)
            return (kind is None or e[0] == kind) and (imm is None or e[2] == imm)

        def matched() -> int:
            return sum(1 for e in self.events if hit(e))

        while True:
            self.events += [tuple(e) for e in self.m.drain()]
            left = deadline - time.monotonic()
            if (kind is not None and matched() >= count) or left <= 0:
                break
            select.select([self.m.fileno()], [], [], min(left, 0.2))
        out, self.events = self.events, []
        return out

    # -- a memfd standing in for a GPU's dma-buf (the loopback device mmaps it, lv_internal.h) --
    def memfd(self, name: str, size: int, seed: int | None = None) -> int:
        import mmap

        fd = os.memfd_create(f"pdkv-test-{name}")
        os.ftruncate(fd, size)
        view = np.frombuffer(mmap.mmap(fd, size), dtype=np.uint8)
        if seed is not None:
            view[:] = np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8)
        self.bufs[name] = view  # no guards: the fd's pages are the whole region
        self.memfds = {**getattr(self, "memfds", {}), name: fd}
        return fd

    def register_device(self, name: str, addr: str = "none") -> list:
        """Messenger.register_device on memfd `name`; addr: none (dma-buf only), host (our own
        mapping: a pointer the kernel can resolve, as nvidia-peermem does for device memory),
        unmapped (a pointer nobody can resolve)."""
        fd, view = self.memfds[name], self.bufs[name]
        ptr = {"none": 0, "host": view.ctypes.data, "unmapped": 0x7e0000000000}[addr]
        return list(self.m.register_device(fd, 0, len(view), ptr))

    def gpudirect_register(self, name: str, ptr: int, facts: list) -> list:
        """pdkv.gpu.gpudirect.register_on_messenger with memfd `name` as the exported dma-buf."""
        from pdkv.gpu.gpudirect import HostFacts, register_on_messenger

        fd = self.memfds[name]
        reg = register_on_messenger(self.m, ptr, len(self.bufs[name]), 0, get_dmabuf_fd=lambda *a: os.dup(fd),
                                    facts=HostFacts((facts[0], facts[1]), facts[2], facts[3]))
        return [reg.key, reg.method.name]

    def nic_metrics(self) -> str:
        """The /metrics text a node exposes for this messenger's NICs (pdkv.messenger.NicMetrics)."""
        from prometheus_client import CollectorRegistry, generate_latest

        from pdkv.messenger import register_nic_metrics

        reg = CollectorRegistry()
        register_nic_metrics(reg, self.m, "test-model", "prefill")
        return generate_latest(reg).decode()

    def device_counters(self, names: list) -> dict:
        """The loopback device's own per-device counts, [tx writes, tx bytes, rx writes, rx bytes]
        by device name (pdkv_loopback_counters: the port counters of a NIC, kept by the device)."""
        return _loopback_query("pdkv_loopback_counters", names, 4)

    def device_objects(self, names: list) -> dict:
        """The loopback device's live objects, [MRs, QPs] by device name (pdkv_loopback_objects)."""
        return _loopback_query("pdkv_loopback_objects", names, 2)

    def resources(self) -> dict:
        return {"threads": len(os.listdir("/proc/self/task")), "fds": len(os.listdir("/proc/self/fd"))}

    def get_baseline(self) -> dict:
        return self.baseline

    def close(self) -> None:
        if self.m is not None:
            self.m.close()
            self.m = None

    def sleep(self, seconds: float) -> None:
        time.sleep(seconds)


def _loopback_query(symbol: str, names: list, width: int) -> dict:
    """{name: the `width` uint64 values `symbol`(name, out) of the loopback device this process
    loaded fills in}; KeyError for a device it does not have."""
    import ctypes

    fn = getattr(ctypes.CDLL("libibverbs.so.1"), symbol)
    out = {}
    for name in names:
        buf = (ctypes.c_uint64 * width)()
        if fn(name.encode(), buf) != 0:
            raise KeyError(f"no loopback device {name!r}")
        out[name] = list(buf)
    return out


def main() -> None:
    out = os.fdopen(os.dup(1), "wb", buffering=0)
    os.dup2(2, 1)
    inp = os.fdopen(0, "rb", buffering=0)
    agent = Agent()
    unpacker = msgpack.Unpacker(raw=False, strict_map_key=False)
    while True:
        data = inp.read(1 << 16)
        if not data:
            return
        unpacker.feed(data)
        for op, args, kwargs in unpacker:
            try:
                res = {"ok": getattr(agent, op)(*args, **kwargs)}
            except Exception as e:  # crosses to the test as data, re-raised there
                res = {"err": type(e).__name__, "msg": str(e), "errno": getattr(e, "errno", None)}
            out.write(msgpack.packb(res, use_bin_type=True))


if __name__ == "__main__":
    main()
