"""The GPU paths for real: skipped, with the reason, on machines without a usable GPU.

They need cuda-python, an NVIDIA driver, a device and a CUDA build of torch; run them on a GPU
machine with ``python -m pytest -q tests/gpu`` (or ``python tools/gpu_check.py``, docs/GPU.md).
"""

from __future__ import annotations

import os

import pytest

from pdkv.gpu import gpu_unavailable_reason

_REASON = gpu_unavailable_reason()
pytestmark = pytest.mark.skipif(_REASON is not None, reason=f"no usable GPU: {_REASON}")


def test_cumem_exported_in_one_process_is_read_and_written_from_another():
    from gpu_check_selftest import check_cumem_two_process

    check_cumem_two_process(nbytes=8 << 20)


def test_counter_bumped_from_a_captured_cuda_graph_is_seen_by_a_host_thread():
    from gpu_check_selftest import check_counter_graph

    check_counter_graph(num_layers=6, replays=2, layer_ms=2.0)


def test_counter_bumped_eagerly_counts_on_the_stream():
    import torch

    from pdkv.gpu.layer_counter import CudaLayerCounter, make_layer_counter

    counter = make_layer_counter("cuda:0")
    try:
        assert isinstance(counter, CudaLayerCounter) and counter.host_address == counter.device_address
        for _ in range(5):
            counter.bump()
        torch.cuda.synchronize()
        assert counter.value() == 5
    finally:
        counter.close()


def test_allocation_rounds_to_the_granularity_and_guards_its_views():
    import torch

    from pdkv.gpu.cumem import CuMemAllocation

    alloc = CuMemAllocation.allocate(3 << 20 | 5)
    try:
        assert alloc.nbytes >= alloc.size == 3 << 20 | 5 and alloc.nbytes % (2 << 20) == 0
        t = alloc.tensor()
        assert t.dtype == torch.uint8 and t.shape == (alloc.size,) and t.data_ptr() == alloc.ptr
        floats = t.view(-1)[: 1 << 20].view(torch.float32)  # a derived view keeps the mapping too
        floats.fill_(1.5)
        del t
        with pytest.raises(RuntimeError, match="1 tensor\\(s\\) over this memory are still alive"):
            alloc.close()
        assert float(floats.sum()) == 1.5 * (1 << 18)
        del floats
    finally:
        alloc.close()
    assert alloc.closed
    with pytest.raises(ValueError, match="closed"):
        alloc.export_fd()


def test_kv_cache_lives_in_cumem_memory():
    import torch

    from pdkv.gpu.cumem import CuMemAllocation
    from pdkv.kv.cache import KVCache

    shape = dict(num_layers=2, num_pages=8, page_size=16, num_kv_heads=2, head_dim=64, dtype=torch.bfloat16)
    nbytes = 2 * 8 * (2 * 2 * 16 * 64) * 2  # layers x pages x (K,V x heads x P x D) x bf16 bytes
    with CuMemAllocation.allocate(nbytes) as alloc:
        buf = alloc.tensor()
        cache = KVCache(**shape, buffer=buf, device="cuda:0")
        assert cache.device == torch.device("cuda", 0) and cache.layer(1).data_ptr() == alloc.ptr + cache.layer_nbytes
        cache.layer(1)[3].fill_(2.0)
        page = buf[cache.layer_nbytes + 3 * cache.page_nbytes:][: cache.page_nbytes].view(torch.bfloat16)
        assert bool((page == 2.0).all())
        del cache, buf, page


def test_importing_a_descriptor_that_is_not_a_cumem_export_is_a_cuda_error():
    from pdkv.gpu.cumem import CuMemAllocation, CuMemInfo
    from pdkv.gpu.guard import CudaError

    with CuMemAllocation.allocate(1 << 20) as real:
        info = real.info
    r, w = os.pipe()
    try:
        with pytest.raises(CudaError, match="cuMemImportFromShareableHandle"):
            CuMemAllocation.import_fd(r, CuMemInfo(info.nbytes, info.size, info.bus_id))
    finally:
        os.close(r)
        os.close(w)


def test_engine_decode_under_cuda_graphs_equals_eager_with_the_counter_captured():
    """model.cuda_graphs on the GPU (CudaGraphCapture): the tokens check and the counter totals of
    tools/gpu_check_graphs.py, on tiny models (the same code gpu_check's decode-graphs runs)."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
    import gpu_check_graphs

    _, data = gpu_check_graphs.run_graphs("cuda", steps=5, speed_model=False)
    assert data["tokens_equal"] and data["counter_bumps"] == data["counter_bumps_issued"] > 0
