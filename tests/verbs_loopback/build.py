"""Builds the userspace loopback verbs device (a test-only libibverbs.so.1) with gcc.

The library is a stand-in for rdma-core's libibverbs that moves RC WRITE / WRITE_WITH_IMM
between processes over Unix sockets (see lv_internal.h). It must only ever be loaded into test
child processes, by putting the directory returned here on their LD_LIBRARY_PATH:

    lib_dir = build_loopback_verbs(tmp_dir)
    subprocess.run(cmd, env={**os.environ, "LD_LIBRARY_PATH": lib_dir})

Builds are cached by a hash of the sources, so repeated calls (and parallel test sessions)
reuse one build.

Environment of the processes that load the device:
  PDKV_LOOPBACK_NICS=a,b   device names (default one device, "lo_verbs0")
  PDKV_LOOPBACK_LINK=ib    InfiniBand port addressed by LID (default: Ethernet/RoCE, by GID)
  PDKV_LOOPBACK_RNR_MS=n   how long an immediate waits for a posted receive (default 2000)
 `build_vtable_test` builds the C program that drives pdkv's verbs transport
(pdkv/csrc/verbs*.c) directly, linked against the real libibverbs for its symbol versions.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
CSRC = HERE.parents[1] / "pdkv" / "csrc"
LIB_SOURCES = sorted(HERE.glob("lv_*.c")) + [HERE / "lv_internal.h", HERE / "libibverbs.map"]
CFLAGS = ["-O2", "-g", "-std=gnu11", "-Wall", "-Werror", "-pthread"]


def default_cache_dir() -> Path:
    """Where test builds are cached across runs: $PDKV_TEST_CACHE or ~/.cache/pdkv-tests.
    Entries are named by a hash of their sources, so a stale build is never reused."""
    return Path(os.environ.get("PDKV_TEST_CACHE") or Path.home() / ".cache" / "pdkv-tests")


class LoopbackUnavailable(RuntimeError):
    """The loopback device cannot be built here (no gcc or no libibverbs headers)."""


def _check_toolchain() -> str:
    gcc = shutil.which("gcc") or shutil.which("cc")
    if gcc is None:
        raise LoopbackUnavailable("no C compiler (gcc) on PATH")
    if not any(Path(d, "infiniband", "verbs.h").exists()
               for d in ("/usr/include", "/usr/local/include")):
        raise LoopbackUnavailable("libibverbs headers (infiniband/verbs.h) are not installed")
    return gcc


def _digest(paths: list[Path], extra: str) -> str:
    h = hashlib.sha256(extra.encode())
    for p in paths:
        h.update(p.name.encode())
        h.update(p.read_bytes())
    return h.hexdigest()[:16]


def _build(out: Path, cmd: list[str]) -> None:
    """Runs `cmd` writing to a temporary name, then renames it to `out` (atomic for racers)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=out.parent, prefix=".build-")
    os.close(fd)
    try:
        proc = subprocess.run(cmd + ["-o", tmp], capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"building {out.name} failed:\n{' '.join(cmd)}\n{proc.stderr}")
        os.chmod(tmp, 0o755)
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def build_loopback_verbs(out_dir: str | os.PathLike) -> str:
    """Builds (or reuses) the loopback libibverbs.so.1 under out_dir.

    Returns the directory that holds libibverbs.so.1, for LD_LIBRARY_PATH of child processes.
    Raises LoopbackUnavailable when the toolchain or headers are missing, RuntimeError when the
    compiler fails.
    """
    gcc = _check_toolchain()
    lib_dir = Path(out_dir) / f"loopback-verbs-{_digest(LIB_SOURCES, ' '.join(CFLAGS))}"
    lib = lib_dir / "libibverbs.so.1"
    if not lib.exists():
        _build(lib, [gcc, *CFLAGS, "-fPIC", "-shared", "-Wl,-soname,libibverbs.so.1",
                     f"-Wl,--version-script={HERE / 'libibverbs.map'}",
                     *[str(p) for p in LIB_SOURCES if p.suffix == ".c"]])
    return str(lib_dir)


def build_vtable_test(out_dir: str | os.PathLike) -> str:
    """Builds (or reuses) vtable_test: pdkv's verbs transport driven through its vtable.

    It links against the REAL libibverbs (so it carries real symbol versions); run it with
    LD_LIBRARY_PATH=build_loopback_verbs(...) to use the loopback device instead.
    """
    gcc = _check_toolchain()
    sources = [*sorted(HERE.glob("vtable_*.c")), *sorted(CSRC.glob("verbs*.c"))]
    headers = [HERE / "vtable_util.h", CSRC / "transport.h", CSRC / "verbs_internal.h"]
    digest = _digest(sources + headers, " ".join(CFLAGS))
    exe = Path(out_dir) / f"vtable-test-{digest}" / "vtable_test"
    if not exe.exists():
        _build(exe, [gcc, *CFLAGS, "-DPDKV_HAVE_VERBS=1", f"-I{CSRC}",
                     *[str(p) for p in sources], "-libverbs"])
    return str(exe)


def build_device_test(out_dir: str | os.PathLike) -> str:
    """Builds (or reuses) device_test: raw-verbs checks of the loopback device itself."""
    gcc = _check_toolchain()
    sources = [HERE / "device_test.c"]
    exe = Path(out_dir) / f"device-test-{_digest(sources, ' '.join(CFLAGS))}" / "device_test"
    if not exe.exists():
        _build(exe, [gcc, *CFLAGS, *[str(p) for p in sources], "-libverbs"])
    return str(exe)
