"""gpu_check's API check: every torch, Triton and cuda-bindings API that pdkv's GPU code calls,
looked up in the versions this machine has, before any check calls them.

The repository pins torch 2.13 (the CPU build its tests run on); a GPU machine brings its own
stack (the H200 image here: torch 2.11.0+cu130, triton 3.6.0, cuda-bindings 13). An API that
appeared after the machine's version fails deep inside a check, minutes into the run; looked up
first, it fails here, in a second, naming the API, the version found and the one needed.
Nothing here needs a GPU or initialises CUDA, so ``--dry-run`` runs it too.

``since`` is the release that introduced the API as pdkv calls it (keyword arguments included);
every entry is far older than the machine's versions. When adding a GPU call, add it here.
"""

from __future__ import annotations

import importlib
import inspect
from dataclasses import dataclass


@dataclass(frozen=True)
class Api:
    name: str  # dotted from the package's top module, as the code spells it
    kwargs: tuple = ()  # keyword arguments the code passes
    since: str = ""  # the first release that has it as used
    used_by: str = ""


TORCH = (
    Api("cuda.CUDAGraph", since="1.10", used_by="pdkv/engine/cuda_graphs.py, tools/gpu_check_selftest.py"),
    Api("cuda.graph", ("pool", "capture_error_mode"), "2.1", "pdkv/engine/cuda_graphs.py"),
    Api("cuda.graph_pool_handle", since="1.10", used_by="pdkv/engine/cuda_graphs.py"),
    Api("cuda.Stream", ("device",), "1.0", "pdkv/gpu/cuda_copy_engine.py"),
    Api("cuda.Event", ("enable_timing",), "1.0", "tools/gpu_check_copy.py"),
    Api("cuda.Event.elapsed_time", since="1.0", used_by="tools/gpu_check_copy.py"),
    Api("cuda.Stream.wait_event", since="1.0", used_by="pdkv/gpu/cuda_copy_engine.py"),
    Api("cuda.Stream.wait_stream", since="1.0", used_by="pdkv/engine/cuda_graphs.py"),
    Api("cuda.stream", since="1.0"), Api("cuda.current_stream", since="1.0"),
    Api("cuda.device", since="1.0"), Api("cuda.set_device", since="1.0"),
    Api("cuda.synchronize", since="1.0"), Api("cuda.device_count", since="1.0"),
    Api("cuda.get_device_properties", since="1.0"), Api("cuda.get_device_name", since="1.0"),
    Api("cuda.set_sync_debug_mode", since="1.10", used_by="tools/gpu_check_models.py (FlashInfer)"),
    Api("cuda.mem_get_info", since="1.11", used_by="pdkv/engine/factory.py"),
    Api("cuda._sleep", since="1.6", used_by="tools/gpu_check_selftest.py (a stand-in layer's duration)"),
    Api("as_tensor", since="1.0", used_by="__cuda_array_interface__ v3 (pdkv/gpu/cumem.py)"),
    Api("empty", ("pin_memory",), "1.0", "pdkv/gpu/staging.py"),
    Api("frombuffer", since="1.10", used_by="pdkv/kv"),
    Api("nn.functional.scaled_dot_product_attention", ("enable_gqa", "scale"), "2.5",
        "models/attention/torch_backend.py"),
    Api("nn.functional.rms_norm", since="2.4", used_by="models/layers.py"),
)
TRITON = (
    Api("jit", since="1.0", used_by="pdkv/gpu/release_bump.py"),
    Api("language.atomic_add", ("sem", "scope"), "2.1", "pdkv/gpu/release_bump.py (release, sys)"),
)
CUDA_DRIVER = tuple(Api(n, since="CUDA 11.4", used_by="pdkv/gpu (cuda.bindings.driver)") for n in (
    "cuInit", "cuDriverGetVersion", "cuGetErrorName", "cuDeviceGet", "cuDeviceGetCount",
    "cuDeviceGetAttribute", "cuDeviceGetByPCIBusId", "cuDeviceGetPCIBusId",
    "cuDevicePrimaryCtxRetain", "cuDevicePrimaryCtxRelease", "cuCtxPushCurrent", "cuCtxPopCurrent",
    "cuCtxSynchronize", "cuMemCreate", "cuMemRelease", "cuMemAddressReserve", "cuMemAddressFree",
    "cuMemMap", "cuMemUnmap", "cuMemSetAccess", "cuMemGetAllocationGranularity",
    "cuMemExportToShareableHandle", "cuMemImportFromShareableHandle", "cuMemHostAlloc",
    "cuMemFreeHost", "cuMemHostGetDevicePointer", "CU_MEMHOSTALLOC_DEVICEMAP",
    "CU_MEMHOSTALLOC_PORTABLE", "CUmemAllocationProp", "CUmemAccessDesc",
    "CUdevice_attribute.CU_DEVICE_ATTRIBUTE_CAN_MAP_HOST_MEMORY",
    "CUdevice_attribute.CU_DEVICE_ATTRIBUTE_COMPUTE_MODE",
    "CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE",
    "CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_RECOMMENDED",
    "CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR",
    "CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED",
    "CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE")) + (
    # dma-buf export for GPUDirect RDMA (pdkv/gpu/gpudirect.py, the dmabuf check)
    Api("cuMemGetHandleForAddressRange", since="CUDA 11.7", used_by="pdkv/gpu/gpudirect.py"),
    Api("CUdevice_attribute.CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED", since="CUDA 11.7"),
    Api("CUmemRangeHandleType.CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD", since="CUDA 11.7"),
)


def _resolve(root, dotted: str):
    obj = root
    for part in dotted.split("."):
        obj = getattr(obj, part)
    return obj


def _takes(obj, kwarg: str) -> bool:
    """Whether ``obj`` (a function or class) accepts ``kwarg``; builtins without a signature are
    read from their docstring, which spells the signature out or documents each parameter."""
    for target in (obj, getattr(obj, "__init__", None), getattr(obj, "__new__", None)):
        try:
            params = inspect.signature(target).parameters
        except (TypeError, ValueError):
            continue
        if kwarg in params:  # a **kwargs says nothing: an inherited one swallows anything
            return True
    doc = getattr(obj, "__doc__", None) or ""
    return f"{kwarg}=" in doc or f":param {kwarg}:" in doc


def missing(root, package: str, version: str, apis) -> list[str]:
    """One line per API of ``apis`` that ``root`` (the imported package) lacks."""
    out = []
    for api in apis:
        where = f"; used by {api.used_by}" if api.used_by else ""
        call = f"{package}.{api.name}" if package != "cuda-bindings" else api.name
        try:
            obj = _resolve(root, api.name)
        except AttributeError:
            out.append(f"{package} {version} has no {call} (needs {package} >= {api.since}{where})")
            continue
        bad = [k for k in api.kwargs if not _takes(obj, k)]
        if bad:
            out.append(f"{package} {version}: {call} takes no {', '.join(k + '=' for k in bad)} "
                       f"(needs {package} >= {api.since}{where})")
    return out


def _cuda_bindings():
    from pdkv.gpu.guard import GPUUnavailable, _load_bindings, bindings_version

    try:
        drv = _load_bindings()  # imports the module only: no driver call, no CUDA context
    except GPUUnavailable as e:
        return None, None, str(e)
    return drv, bindings_version(drv), None


def check_apis() -> tuple[str, dict]:
    torch = importlib.import_module("torch")
    problems = missing(torch, "torch", torch.__version__, TORCH)
    found = {"torch": torch.__version__}
    notes = []
    try:
        triton = importlib.import_module("triton")
        importlib.import_module("triton.language")  # the attribute exists once the module is loaded
    except ImportError as e:
        notes.append(f"triton not installed ({e}): the layer counter bumps with torch's add_ "
                     "and counter-graph is SKIP")
    else:
        found["triton"] = triton.__version__
        problems += missing(triton, "triton", triton.__version__, TRITON)
    drv, version, why = _cuda_bindings()
    if drv is None:
        notes.append(f"cuda-bindings not checked: {why}")
    else:
        found["cuda-bindings"] = version
        problems += missing(drv, "cuda-bindings", version, CUDA_DRIVER)
        if not problems and not hasattr(drv.CUmemAllocationProp().allocFlags, "gpuDirectRDMACapable"):
            problems.append(f"cuda-bindings {version}: CUmemAllocationProp.allocFlags has no "
                            "gpuDirectRDMACapable (needs CUDA 11.4; used by pdkv/gpu/cumem.py)")
    checked = len(TORCH) + (len(TRITON) if "triton" in found else 0) + (len(CUDA_DRIVER) if drv else 0)
    assert not problems, "; ".join(problems)
    versions = ", ".join(f"{k} {v}" for k, v in found.items())
    noted = f" ({'; '.join(notes)})" if notes else ""
    return f"{checked} APIs pdkv's GPU code calls are in {versions}{noted}", {
        "versions": found, "checked": checked, "notes": notes}
