#!/usr/bin/env python3
"""One-shot check of pdkv's GPU building blocks on a machine with an NVIDIA GPU.

    python3 tools/gpu_check.py            # from the repository root; about a minute

Needs torch with CUDA and cuda-python (``pip install cuda-python``; ``cuda-bindings`` is
enough). Prints the environment, then one ``PASS`` / ``FAIL`` / ``SKIP`` line per check, and exits
non-zero if any check failed. Checks:

  guard        pdkv.gpu sees cuda-python, the driver and the device
  cumem-2proc  cuMem allocation exported by a child process as a POSIX fd (SCM_RIGHTS), imported
               and mapped here; bytes written on each side are read on the other
  cumem-views  rounding to the granularity; close() refuses while tensors over it live
  kvcache      a KVCache laid over cuMem memory: a page written through torch is where the
               messenger will read it
  bad-import   importing a descriptor that is not a cuMem export is a CudaError, not a crash
  dmabuf       a dma-buf fd for the mapping (what ibv_reg_dmabuf_mr takes); SKIP if unsupported
  counter      CudaLayerCounter bumped eagerly on the stream
  counter-graph  bumps inside a captured CUDA graph, replayed; a host thread sees the counter
               climb layer by layer before the host synchronises
"""

from __future__ import annotations

import os
import platform
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, no install


def environment() -> None:
    import torch

    print(f"python {platform.python_version()}  torch {torch.__version__} (CUDA {torch.version.cuda})")
    try:
        import cuda.bindings

        print(f"cuda-bindings {cuda.bindings.__version__}")
    except Exception as e:  # noqa: BLE001
        print(f"cuda-bindings: {e}")
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        print(f"cuda:0 {p.name}, {p.total_memory >> 30} GiB, sm_{p.major}{p.minor}, "
              f"{torch.cuda.device_count()} device(s); CUDA_VISIBLE_DEVICES="
              f"{os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')}")
    try:
        from pdkv.gpu.guard import call, cuda_driver

        drv = cuda_driver("gpu_check")
        v = call(drv, drv.cuDriverGetVersion)
        print(f"driver API {v // 1000}.{v % 1000 // 10}")
    except Exception as e:  # noqa: BLE001
        print(f"driver: {e}")


def check_guard() -> str:
    from pdkv.gpu import gpu_unavailable_reason

    reason = gpu_unavailable_reason()
    assert reason is None, reason
    return "cuda-python, driver, device and torch CUDA all present"


def check_cumem_2proc() -> str:
    from pdkv.gpu.selftest import check_cumem_two_process

    return check_cumem_two_process(nbytes=64 << 20)


def check_cumem_views() -> str:
    import torch

    from pdkv.gpu.cumem import CuMemAllocation

    alloc = CuMemAllocation.allocate((3 << 20) + 5)
    try:
        assert alloc.nbytes >= alloc.size and alloc.nbytes % (2 << 20) == 0, repr(alloc)
        t = alloc.tensor()
        assert t.data_ptr() == alloc.ptr and t.dtype == torch.uint8 and t.numel() == alloc.size
        h = t[: 1 << 20].view(torch.float32)
        h.fill_(1.5)
        del t
        try:
            alloc.close()
            raise AssertionError("close() did not refuse while a view was alive")
        except RuntimeError as e:
            assert "still alive" in str(e), e
        assert float(h.sum()) == 1.5 * (1 << 18)
        del h
    finally:
        alloc.close()
    return f"{alloc!r}"


def check_kvcache() -> str:
    import torch

    from pdkv.gpu.cumem import CuMemAllocation
    from pdkv.kv.cache import KVCache

    shape = dict(num_layers=2, num_pages=8, page_size=16, num_kv_heads=2, head_dim=64, dtype=torch.bfloat16)
    nbytes = 2 * 8 * (2 * 2 * 16 * 64) * 2
    with CuMemAllocation.allocate(nbytes) as alloc:
        buf = alloc.tensor()
        cache = KVCache(**shape, buffer=buf, device="cuda:0")
        cache.layer(1)[3].fill_(2.0)
        off = cache.page_offset(1, 3)
        page = buf[off: off + cache.page_nbytes].view(torch.bfloat16)
        ok = bool((page == 2.0).all()) and cache.data_ptr(0) == alloc.ptr
        del cache, buf, page
    assert ok, "page (1, 3) is not at data_ptr(0) + page_offset(1, 3)"
    return "KVCache(HND, bf16) over cuMem: page offsets match the bytes torch wrote"


def check_bad_import() -> str:
    from pdkv.gpu.cumem import CuMemAllocation
    from pdkv.gpu.guard import CudaError

    with CuMemAllocation.allocate(1 << 20) as real:
        info = real.info
    r, w = os.pipe()
    try:
        CuMemAllocation.import_fd(r, info)
        raise AssertionError("a pipe was imported as cuMem memory")
    except CudaError as e:
        return f"refused: {e}"
    finally:
        os.close(r)
        os.close(w)


class Skip(Exception):
    """A check that cannot run on this machine for a stated reason (not a failure)."""


def check_dmabuf() -> str:
    from pdkv.gpu.cumem import CuMemAllocation
    from pdkv.gpu.guard import CudaError

    with CuMemAllocation.allocate(4 << 20) as alloc:
        try:
            fd = alloc.dmabuf_fd()
        except CudaError as e:
            if e.code == 801:  # CUDA_ERROR_NOT_SUPPORTED
                raise Skip(str(e)) from None
            raise
        try:
            size = os.lseek(fd, 0, os.SEEK_END)
        finally:
            os.close(fd)
    assert size in (0, alloc.nbytes), f"dma-buf of {size} bytes for a {alloc.nbytes}-byte mapping"
    return f"dma-buf fd for {alloc.nbytes} bytes (lseek says {size}) for ibv_reg_dmabuf_mr"


def check_counter() -> str:
    import torch

    from pdkv.gpu.layer_counter import make_layer_counter

    c = make_layer_counter("cuda:0")
    try:
        for _ in range(5):
            c.bump()
        torch.cuda.synchronize()
        assert c.value() == 5, c.value()
        return f"5 eager bumps -> 5; host {c.host_address:#x}, device {c.device_address:#x}"
    finally:
        c.close()


def check_counter_graph() -> str:
    from pdkv.gpu.selftest import check_counter_graph as run

    return run(num_layers=8, replays=3, layer_ms=2.0)


CHECKS = [("guard", check_guard), ("cumem-2proc", check_cumem_2proc), ("cumem-views", check_cumem_views),
          ("kvcache", check_kvcache), ("bad-import", check_bad_import), ("dmabuf", check_dmabuf), ("counter", check_counter),
          ("counter-graph", check_counter_graph)]


def main() -> int:
    environment()
    passed = failed = 0
    for i, (name, fn) in enumerate(CHECKS):
        t0 = time.monotonic()
        try:
            detail = fn()
            passed += 1
            print(f"PASS {name} ({time.monotonic() - t0:.1f}s): {detail}", flush=True)
        except Skip as e:
            print(f"SKIP {name}: {e}", flush=True)
        except Exception as e:  # noqa: BLE001 - report every check; the exit code sums them up
            failed += 1
            print(f"FAIL {name} ({time.monotonic() - t0:.1f}s): {type(e).__name__}: {e}", flush=True)
            if name == "guard":  # nothing else can run; the reason says what is missing
                for rest, _ in CHECKS[i + 1:]:
                    print(f"SKIP {rest}: no usable GPU")
                break
            traceback.print_exc(limit=8, file=sys.stdout)
    print(f"{passed} passed, {failed} failed, {len(CHECKS) - passed - failed} skipped", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
