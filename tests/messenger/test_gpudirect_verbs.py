"""GPUDirect RDMA registration in the C verbs transport (csrc/verbs_gpudirect.c), on the loopback
verbs device, whose ibv_reg_dmabuf_mr maps the fd it is given: a memfd stands in for the dma-buf
the CUDA driver exports for GPU memory (a test stand-in, lv_internal.h). Writes into and out of
dma-buf-registered memory must be byte-exact, through grants in per-peer protection domains
(every MR of the region is a dma-buf registration) and on every NIC of a multi-NIC transport; a
failed dma-buf import falls back to the device pointer (nvidia-peermem); when both fail the
error names both attempts and what the host lacks.
"""
from __future__ import annotations

import pytest

SIZE = 64 << 10
NICS = "lo_a,lo_b"


@pytest.fixture
def transport():
    from pdkv._messenger import HAVE_VERBS

    if not HAVE_VERBS:
        pytest.skip("pdkv built without libibverbs")
    return "verbs"


def _pair(spawn, connect, faults=""):
    env = {"PDKV_LOOPBACK_NICS": NICS, "PDKV_LOOPBACK_FAULTS": faults}
    a = spawn(1, env_extra=env, nics=NICS.split(","), isolate_peers=True)
    b = spawn(2, env_extra=env, nics=NICS.split(","), isolate_peers=True)
    return a, b


def _write(a, ca, lkey, rkey, off, length, tag):
    a.m("write", ca, lkey, off, rkey, off, length, imm=tag, tag=tag)
    done = [e for e in a.wait("batch_done") if e[0] == "batch_done"]
    assert [(e[1], e[6]) for e in done] == [(tag, 0)], done


def test_writes_into_and_out_of_dmabuf_memory_are_byte_exact(spawn, connect):
    a, b = _pair(spawn, connect)
    a.alloc("host", SIZE, seed=3)
    b.memfd("gpu", SIZE)
    key, how = b.register_device("gpu")  # dma-buf only: no device pointer to fall back on
    assert how == "dmabuf"
    lkey = a.register("host")
    ca, cb = connect(a, b)
    for nic in (0, 1):  # the region is a dma-buf MR on both NICs, granted in A's PD on each
        rkey = b.m("grant", b.m("nic_key", key, nic), 1)
        _write(a, ca, a.m("nic_key", lkey, nic), rkey, nic * 4096 + 100, 3000, tag=10 + nic)
    got, src = b.read("gpu"), a.read("host")
    for nic in (0, 1):
        lo = nic * 4096 + 100
        assert got[lo:lo + 3000] == src[lo:lo + 3000]
    assert got[:100] == bytes(100) and got[4096 + 3100:] == bytes(SIZE - 4096 - 3100)
    # out of it: B's dma-buf region is the source of a write into A's host memory
    a.alloc("back", SIZE)
    back = a.m("grant", a.register("back"), 2)
    _write(b, cb, key, back, 0, SIZE, tag=20)
    assert a.read("back") == b.read("gpu")
    # a narrow grant is one more dma-buf registration, of just its range
    rng = b.m("grant_range", key, 1, 8192, 4096)
    _write(a, ca, lkey, rng, 8192, 4096, tag=30)
    assert b.read("gpu", 8192, 4096) == a.read("host", 8192, 4096)
    b.m("revoke_range", key, 1, 8192, 4096)
    b.m("revoke", b.m("nic_key", key, 1), 1)
    b.m("deregister", key)  # closes the transport's dups of the fd


def test_a_failed_dmabuf_import_falls_back_to_the_device_pointer(spawn, connect):
    a, b = _pair(spawn, connect, faults="no_dmabuf")
    a.alloc("host", SIZE, seed=4)
    b.memfd("gpu", SIZE)
    key, how = b.register_device("gpu", addr="host")  # the pointer a peer-memory client resolves
    assert how == "peermem"
    ca, _ = connect(a, b)
    _write(a, ca, a.register("host"), b.m("grant", key, 1), 0, SIZE, tag=1)
    assert b.read("gpu") == a.read("host")


def test_when_neither_way_works_the_error_names_both_and_what_the_host_lacks(spawn):
    _, b = _pair(spawn, None, faults="no_dmabuf,no_peermem")
    b.memfd("gpu", SIZE)
    with pytest.raises(Exception) as ei:
        b.register_device("gpu", addr="unmapped")
    msg = str(ei.value)
    assert "TransportUnavailableError" in msg and "ibv_reg_dmabuf_mr(fd" in msg and "Operation not supported" in msg
    assert "ibv_reg_mr on the device pointer 0x7e0000000000 failed: Bad address" in msg and "nvidia-peermem" in msg
    # the Python side adds what this host lacks (facts as a host without either way would report)
    with pytest.raises(Exception) as ei:
        b.gpudirect_register("gpu", 0x7e0000000000, [5, 4, "proprietary", None])
    msg = str(ei.value)
    assert "GPUDirectUnavailable" in msg and "ibv_reg_dmabuf_mr" in msg and "ibv_reg_mr on the device pointer" in msg
    assert "dma-buf needs Linux >= 5.12" in msg and "nvidia-peermem is not loaded" in msg
    with pytest.raises(Exception, match="needs a length and a dma-buf fd or a device pointer"):
        b.m("register_device", -1, 0, SIZE, 0)


def test_register_on_messenger_uses_the_c_path(spawn, connect):
    a, b = _pair(spawn, connect)
    b.memfd("gpu", SIZE)
    key, method = b.gpudirect_register("gpu", 0, [6, 8, "open", None])
    assert method == "DMABUF"
    a.alloc("host", SIZE, seed=9)
    ca, _ = connect(a, b)
    _write(a, ca, a.register("host"), b.m("grant", key, 1), 0, SIZE, tag=2)
    assert b.read("gpu") == a.read("host")
