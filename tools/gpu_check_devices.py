"""Device-level GPU checks for tools/gpu_check.py: the guard, compute mode, cuMem, dma-buf,
GPUDirect host facts, the layer counter, the staging copy engine.

Each check returns a one-line summary (or ``(summary, data)``), raises SkipCheck with a reason,
or raises on failure. :func:`no_gpu_reason` tells "this machine has no GPU" (every check SKIP,
exit 0) apart from "a GPU is here but something is missing" (the guard FAILs).
"""

from __future__ import annotations

import ctypes
import importlib.metadata
import os
import platform
import shlex
import shutil
import subprocess
import sys
import sysconfig

from gpu_check_models import SkipCheck


def environment() -> dict:
    """Versions and the device, as far as they can be read here (never raises)."""
    env = {"python": f"{platform.python_version()} ({sys.executable})"}
    try:
        import torch

        env["torch"] = f"{torch.__version__} (CUDA {torch.version.cuda})"
        if torch.cuda.is_available():
            p = torch.cuda.get_device_properties(0)
            env["device"] = (f"cuda:0 {p.name}, {p.total_memory >> 30} GiB, sm_{p.major}{p.minor}, "
                             f"{torch.cuda.device_count()} visible")
    except Exception as e:  # noqa: BLE001
        env["torch"] = f"unavailable: {e}"
    env["CUDA_VISIBLE_DEVICES"] = os.environ.get("CUDA_VISIBLE_DEVICES", "unset")
    try:
        from pdkv.gpu.guard import _load_bindings, bindings_version

        drv = _load_bindings()
        env["cuda-bindings"] = bindings_version(drv)
        status, version = drv.cuDriverGetVersion()
        if int(status) == 0:
            env["driver CUDA version"] = f"{version // 1000}.{version % 1000 // 10}"
    except Exception as e:  # noqa: BLE001
        env["driver"] = str(e)
    for name in ("triton", "flashinfer"):
        try:
            env[name] = __import__(name).__version__
        except Exception as e:  # noqa: BLE001
            env[name] = f"unavailable ({type(e).__name__})"
    # the rest of what the checks and the build step import, by distribution name
    for dist in ("numpy", "cython", "setuptools", "pyyaml", "safetensors", "tokenizers", "aiohttp",
                 "prometheus-client", "msgpack", "jinja2", "ninja"):
        try:
            env[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            env[dist] = "not installed"
    env["nvcc"] = _first_line(["nvcc", "--version"], last=True)
    from gpu_check_build import _compiler_env, toolchain_problem

    cc = shlex.split(_compiler_env()[0].get("CC") or sysconfig.get_config_var("CC") or "cc")[0]
    env["C compiler"] = f"{cc}: {_first_line([cc, '--version'])}"
    env["build toolchain"] = toolchain_problem() or "complete (C compiler, Python headers, Cython, setuptools)"
    return env


def _first_line(cmd: list[str], last: bool = False) -> str:
    """The first (or last) line a tool prints about its version, or why there is none."""
    if shutil.which(cmd[0]) is None:
        return "not on PATH"
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=20).stdout.strip().splitlines()
    except (OSError, subprocess.SubprocessError) as e:
        return f"unavailable ({type(e).__name__})"
    return (out[-1] if last else out[0]) if out else "no output"


def no_gpu_reason() -> str | None:
    """Why this machine has no GPU at all (no driver library, or the driver sees no device)."""
    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError as e:
        return f"no NVIDIA driver (libcuda.so.1 cannot be loaded: {e})"
    from pdkv.gpu.guard import GPUUnavailable, cuda_driver

    try:
        cuda_driver("gpu_check")
    except GPUUnavailable as e:
        if "no CUDA device" in str(e):
            return str(e)
    return None  # a driver and a device: whatever else is missing is a FAIL of the guard


def multiprocess_problem() -> str | None:
    from pdkv.gpu import compute_mode

    try:
        mode = compute_mode.query_driver(0)
    except Exception:  # noqa: BLE001 - unknown: let the checks run and say what they say
        mode = compute_mode.query_nvidia_smi(0) or compute_mode.MULTI_PROCESS_OK
    return compute_mode.problem(mode)


def check_guard() -> str:
    from pdkv.gpu import gpu_unavailable_reason

    reason = gpu_unavailable_reason()
    assert reason is None, reason
    return "cuda-python for this driver's CUDA major, driver, device, torch with CUDA and numpy all present"


def check_compute_mode() -> tuple[str, dict]:
    from pdkv.gpu import compute_mode

    mode = compute_mode.query_driver(0)
    smi = compute_mode.query_nvidia_smi(0)
    problem = compute_mode.problem(mode)
    if problem:
        raise SkipCheck(problem)
    return f"cuda:0 compute mode {mode} (nvidia-smi: {smi or 'not available'})", {"mode": mode, "nvidia_smi": smi}


def check_cumem_2proc() -> str:
    from gpu_check_selftest import check_cumem_two_process

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


def check_dmabuf() -> str:
    from pdkv.gpu.cumem import CuMemAllocation
    from pdkv.gpu.gpudirect import DMABUF_UNSUPPORTED, is_unsupported

    with CuMemAllocation.allocate(4 << 20) as alloc:
        try:
            fd = alloc.dmabuf_fd()
        except Exception as e:  # noqa: BLE001 - told apart below: unsupported is a SKIP
            if is_unsupported(e):
                raise SkipCheck(f"this driver/kernel module exports no dma-buf ({e}); expected with NVIDIA's "
                                f"proprietary module (codes treated so: {sorted(DMABUF_UNSUPPORTED.values())})") from None
            raise
        try:
            size = os.lseek(fd, 0, os.SEEK_END)
        finally:
            os.close(fd)
    assert size in (0, alloc.nbytes), f"dma-buf of {size} bytes for a {alloc.nbytes}-byte mapping"
    return f"dma-buf fd for {alloc.nbytes} bytes (lseek says {size}) for ibv_reg_dmabuf_mr"


def check_gpudirect_host() -> tuple[str, dict]:
    from pdkv.gpu.gpudirect import gpudirect_possible, host_gpudirect_facts

    facts = host_gpudirect_facts()
    ok, why = gpudirect_possible(facts)
    data = {"kernel": ".".join(map(str, facts.kernel)), "nvidia_module": facts.nvidia_module,
            "peermem_module": facts.peermem_module, "gpudirect_possible": ok, "lacks": facts.lacks()}
    verdict = "GPUDirect RDMA possible" if ok else f"no GPUDirect RDMA here ({why}): verbs needs staging"
    return (f"Linux {data['kernel']}, NVIDIA {facts.nvidia_module} kernel module, peer memory module "
            f"{facts.peermem_module or 'not loaded'}: {verdict}"), data


def check_counter() -> tuple[str, dict]:
    import torch

    from pdkv.gpu.layer_counter import make_layer_counter

    c = make_layer_counter("cuda:0")
    try:
        for _ in range(5):
            c.bump()
        torch.cuda.synchronize()
        assert c.value() == 5, c.value()
        return (f"5 eager bumps -> 5 with {c.bump_kind.value}"
                f"{'' if c.bump_fallback_reason is None else ' (fallback: ' + c.bump_fallback_reason + ')'}; "
                f"host {c.host_address:#x}, device {c.device_address:#x}"), {"bump_kind": c.bump_kind.name,
                                                                         "fallback_reason": c.bump_fallback_reason}
    finally:
        c.close()


def check_counter_graph_triton() -> str:
    import importlib.util

    from gpu_check_selftest import check_counter_graph

    if importlib.util.find_spec("triton") is None:
        raise SkipCheck("triton is not installed: the counter bump falls back to torch add_ "
                        "(counter-graph-torch covers that); CUDA builds of torch ship triton")
    return check_counter_graph(num_layers=8, replays=3, layer_ms=2.0, bump="triton")


def check_counter_graph_torch() -> str:
    from gpu_check_selftest import check_counter_graph

    return check_counter_graph(num_layers=8, replays=3, layer_ms=2.0, bump="torch")


def check_copy_engine() -> tuple[str, dict]:
    from gpu_check_copy import check_copy_engine as run

    return run(total_mib=1024, num_slots=8, slot_mib=16, page_kib=64)
