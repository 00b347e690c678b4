"""A description of the machine a run measured, for the report: CPUs, memory, load, versions."""

from __future__ import annotations

import os
import platform
from importlib import metadata


def _cpu_model() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _mem_total() -> int | None:
    try:
        for line in open("/proc/meminfo"):
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _version(pkg: str) -> str | None:
    try:
        return metadata.version(pkg)
    except metadata.PackageNotFoundError:
        return None


def describe(budget: list[int]) -> dict:
    return {"hostname": platform.node(), "platform": platform.platform(), "cpu_model": _cpu_model(),
            "num_cpus": os.cpu_count(), "cpus_allowed": sorted(os.sched_getaffinity(0)),
            "budget_cpus": budget, "memory_bytes": _mem_total(), "loadavg_start": os.getloadavg(),
            "python": platform.python_version(), "torch": _version("torch")}
