"""What an architecture costs the machine: resident memory, CPU time, energy.

* Memory: the summed RSS of every process of the architecture, sampled every ``period`` s during
  the replay (peak and mean), plus the weight bytes each node loads. RSS counts a page shared by
  two processes twice (shared weights, the shm transport's KV pool): the peak summed PSS (each
  shared page split among its users), with the /dev/shm files the processes hold counted whole
  (``held_bytes``: PSS misses their untouched pages), is the memory the architecture really holds;
  ``peak_memory`` breaks that peak down per process (PSS without the /dev/shm files, private
  bytes) with the files once. Disaggregation keeps one copy of the weights per node, so
  duplicated weight memory = (nodes - 1) x weight bytes.
* Energy: RAPL package counters (``/sys/class/powercap/intel-rapl:*/energy_uj``) when readable;
  they count the whole package, other processes included. Otherwise CPU-seconds consumed by the
  architecture's processes, labelled as a proxy (not joules). (GPU energy from NVML is not read
  yet: disaggregated nodes run on CPUs only, see pdkv.config.)
"""

from __future__ import annotations

import glob
import os
import threading
import time
from pathlib import Path
from typing import Callable

_TICK = os.sysconf("SC_CLK_TCK")
_PAGE = os.sysconf("SC_PAGE_SIZE")


def rss_bytes(pid: int) -> int:
    try:
        return int(open(f"/proc/{pid}/statm").read().split()[1]) * _PAGE
    except (OSError, IndexError, ValueError):
        return 0


def pss_bytes(pid: int) -> int:
    """Proportional set size: shared pages divided among the processes mapping them."""
    try:
        for line in open(f"/proc/{pid}/smaps_rollup"):
            if line.startswith("Pss:"):
                return int(line.split()[1]) * 1024
    except (OSError, IndexError, ValueError):
        pass
    return 0


def shm_files(pid: int, files: dict) -> None:
    """Adds to ``files`` ({(dev, inode): allocated bytes}) the /dev/shm files ``pid`` holds open."""
    try:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                if not os.readlink(f"/proc/{pid}/fd/{fd}").startswith("/dev/shm/"):
                    continue
                st = os.stat(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            files[(st.st_dev, st.st_ino)] = st.st_blocks * 512
    except OSError:
        pass


def shm_mapped_pss(pid: int, inodes: set) -> int:
    """The PSS of ``pid``'s mappings of the /dev/shm files ``inodes`` (what ``held_bytes`` counts
    whole instead): whoever holds a file open, so a peer's granted pages mapped here count once."""
    pss, counted = 0, False
    try:
        for line in open(f"/proc/{pid}/smaps"):
            head = line.split(maxsplit=5)
            if "-" in head[0] and len(head) >= 5:  # a mapping's first line: range perms off dev inode path
                counted = len(head) == 6 and head[5].startswith("/dev/shm/") and int(head[4]) in inodes
            elif counted and head[0] == "Pss:":
                pss += int(head[1]) * 1024
    except (OSError, ValueError, IndexError):
        return 0
    return pss


def private_bytes(pid: int) -> int:
    """Pages only this process maps (Private_Clean + Private_Dirty of smaps_rollup)."""
    total = 0
    try:
        for line in open(f"/proc/{pid}/smaps_rollup"):
            if line.startswith(("Private_Clean:", "Private_Dirty:")):
                total += int(line.split()[1]) * 1024
    except (OSError, IndexError, ValueError):
        return 0
    return total


def held_breakdown(pids) -> dict:
    """``held_bytes`` in its parts: ``procs``, per pid (in order) its PSS without the /dev/shm
    files it holds and its private bytes, and those files' bytes counted whole and once
    (``shm_bytes``)."""
    files: dict = {}
    for p in pids:
        shm_files(p, files)
    inodes = {ino for _, ino in files}
    procs = [{"pid": p, "pss_bytes": pss_bytes(p) - shm_mapped_pss(p, inodes), "private_bytes": private_bytes(p)}
             for p in pids]
    shm = sum(files.values())
    return {"procs": procs, "shm_bytes": shm, "held_bytes": shm + sum(v["pss_bytes"] for v in procs)}


def held_bytes(pids) -> int:
    """The memory ``pids`` hold: their PSS, with the /dev/shm files they hold open counted whole
    and once. PSS counts a tmpfs page only in a process that touched it, but the shm transport
    allocates its files whole at registration (moving only the non-zero pages), so a KV pool
    there holds its memory whether or not any process has touched it yet."""
    return held_breakdown(pids)["held_bytes"]


def cpu_seconds(pid: int) -> float:
    try:
        f = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
        return (int(f[11]) + int(f[12])) / _TICK  # utime + stime
    except (OSError, IndexError, ValueError):
        return 0.0


def weight_bytes(model_dir: str) -> int:
    return sum(p.stat().st_size for p in Path(model_dir).glob("*.safetensors"))


def rapl_uj() -> dict[str, tuple[int, int]] | None:
    """{zone: (energy_uj, max_range_uj)} of readable package zones, None if none is readable."""
    out = {}
    for z in glob.glob("/sys/class/powercap/intel-rapl:*"):
        if z.count(":") != 1:  # packages only; subzones are included in them
            continue
        try:
            out[z] = (int(open(z + "/energy_uj").read()), int(open(z + "/max_energy_range_uj").read()))
        except (OSError, ValueError):
            continue
    return out or None


class Sampler:
    """Samples RSS and CPU time of ``pids()`` in a thread; keeps the last CPU time seen per pid so a
    process killed mid-replay still counts what it used."""

    def __init__(self, pids: Callable[[], list[int]], period: float = 0.25,
                 names: Callable[[], dict[int, str]] | None = None):
        """``names()``: {pid: what it is} (a node's name) for the memory breakdown at the peak."""
        self._pids, self._period, self._names = pids, period, names
        self.peak_memory: dict = {}
        self._stop = threading.Event()
        self.peak_rss = self.peak_pss = self.peak_held = 0
        self._rss_sum, self._n = 0, 0
        self._cpu0: dict[int, float] = {}
        self._cpu_last: dict[int, float] = {}
        self._thread = threading.Thread(target=self._run, name="ab-sampler", daemon=True)

    def start(self) -> "Sampler":
        for p in self._pids():
            self._cpu0[p] = self._cpu_last[p] = cpu_seconds(p)
        self._rapl0, self._t0 = rapl_uj(), time.monotonic()
        self._thread.start()
        return self

    def _sample(self) -> None:
        total = pss = 0
        pids = self._pids()
        parts = held_breakdown(pids)
        held = parts["held_bytes"]
        if held > self.peak_held:  # who held what at the peak (the memory table of the report)
            names = self._names() if self._names else {}
            self.peak_memory = {"shm_bytes": parts["shm_bytes"], "held_bytes": held,
                                "procs": [{"name": names.get(v["pid"], str(v["pid"])), **v} for v in parts["procs"]]}
        for p in pids:
            total += rss_bytes(p)
            pss += pss_bytes(p)
            c = cpu_seconds(p)
            if c:
                self._cpu_last[p] = c
                self._cpu0.setdefault(p, 0.0)  # a process started during the replay counts from 0
        self.peak_rss = max(self.peak_rss, total)
        self.peak_pss = max(self.peak_pss, pss)
        self.peak_held = max(self.peak_held, held)
        self._rss_sum += total
        self._n += 1

    def _run(self) -> None:
        while not self._stop.wait(self._period):
            self._sample()

    def stop(self) -> dict:
        self._sample()
        self._stop.set()
        self._thread.join(5)
        wall = time.monotonic() - self._t0
        cpu = sum(self._cpu_last[p] - self._cpu0.get(p, 0.0) for p in self._cpu_last)
        out = {"peak_rss_bytes": self.peak_rss, "peak_pss_bytes": self.peak_pss, "peak_held_bytes": self.peak_held,
               "peak_memory": self.peak_memory, "mean_rss_bytes": self._rss_sum // max(1, self._n),
               "cpu_seconds": cpu, "wall_seconds": wall}
        rapl1 = rapl_uj()
        if self._rapl0 and rapl1:
            joules = 0.0
            for z, (e0, rng) in self._rapl0.items():
                e1 = rapl1.get(z, (e0, rng))[0]
                joules += ((e1 - e0) % rng if rng else e1 - e0) / 1e6
            out["energy"] = {"source": "rapl", "joules": joules,
                             "note": "RAPL package counters: the whole package, other processes included"}
        else:
            out["energy"] = {"source": "cpu_seconds_proxy", "joules": None, "cpu_seconds": cpu,
                             "note": "no readable RAPL counter under /sys/class/powercap: CPU-seconds of the "
                                     "architecture's processes as a proxy for energy (not joules)"}
        return out
