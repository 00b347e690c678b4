"""verbs robustness against what a provider can do, each case injected through the
loopback device's fault hooks (PDKV_LOOPBACK_FAULTS, see tests/verbs_loopback/lv_internal.h):

- ibv_poll_cq returning an error and IBV_EVENT_CQ_ERR (an overrun) are fatal for every connection
  on the CQ: outstanding writes fail, the peer is told why, no new connection is made — they are
  not "idle", which would leave every write waiting forever;
- a provider that flushes only signaled WRs: the unsignaled writes after an error must be
  reported failed, never done.
"""
from __future__ import annotations

import pytest

SIZE = 64 << 10


@pytest.fixture
def transport(request):
    from pdkv._messenger import HAVE_VERBS

    if not HAVE_VERBS:
        pytest.skip("pdkv built without libibverbs")
    return "verbs"


def _setup(spawn, connect, faults: str):
    a = spawn(1, env_extra={"PDKV_LOOPBACK_FAULTS": faults})
    b = spawn(2)
    a.alloc("src", SIZE, seed=1)
    b.alloc("dst", SIZE)
    lkey, rkey = a.register("src"), b.register("dst")
    b.m("grant", rkey, 1)
    ca, _ = connect(a, b)
    return a, b, ca, lkey, rkey


@pytest.mark.parametrize("faults, why", [("poll_error_after=2", "ibv_poll_cq failed"),
                                         ("cq_error_after=2", "IBV_EVENT_CQ_ERR")])
def test_a_broken_cq_fails_its_connections(spawn, connect, faults, why):
    a, b, ca, lkey, rkey = _setup(spawn, connect, faults)
    for tag in (1, 2):  # two signaled completions: the CQ still works
        a.m("write", ca, lkey, 0, rkey, 0, 64, tag=tag)
        assert [e[1] for e in a.wait("batch_done") if e[0] == "batch_done"] == [tag]
    a.m("write_pages", ca, lkey, rkey, [0] * 8, list(range(8)), seg_len=64, dst_page_stride=64, tag=3)
    evs = a.wait("batch_done", timeout=10)
    done = [e for e in evs if e[0] == "batch_done" and e[1] == 3]
    assert done and done[0][6] > 0, evs  # the batch ended, with errors: not left waiting
    errs = [e for e in evs + a.wait(timeout=0.3) if e[0] == "error"]
    assert any(why in e[8] and e[3] == 2 for e in errs), errs  # the connection to node 2 failed
    with pytest.raises(Exception, match="PeerConnectionError"):
        a.m("write", ca, lkey, 0, rkey, 0, 64)
    with pytest.raises(Exception, match="completion queue failed"):
        a.m("prepare", 2)


def test_flush_of_signaled_wrs_only_reports_every_unlanded_write(spawn, connect):
    a, b, ca, lkey, rkey = _setup(spawn, connect, "flush_signaled_only")
    # 101 writes in one batch; the 11th is outside the region: it fails at the target, the 90
    # after it are flushed, the first 10 landed
    dst_pages = list(range(10)) + [SIZE] + list(range(10, 100))
    n = a.m("write_pages", ca, lkey, rkey, [0] * len(dst_pages), dst_pages, seg_len=64, dst_page_stride=64, tag=7)
    assert n == 101
    done = [e for e in a.wait("batch_done", timeout=10) if e[0] == "batch_done"]
    assert done and done[0][1] == 7 and done[0][4] == 101
    assert done[0][6] == 91, done  # every write from the bad one on failed; none reported done
    src = a.read("src", 0, 64)
    assert all(b.read("dst", 64 * i, 64) == src for i in range(10))
    assert b.read("dst", 640) == bytes(SIZE - 640)
