"""FAULT INJECTION: deregistering a region held by several NICs when one NIC says busy.

A verbs region is registered on every NIC of the transport (pdkv/csrc/verbs_multi_mr.c). The
loopback device's ``dereg_busy_nic`` hook (tests/verbs_loopback/lv_internal.h) makes
``ibv_dereg_mr`` on one device fail with EBUSY, as a provider does while it still uses the MR.
Deregistration is all-or-retry: the other NICs' MRs go, the busy NIC keeps its MR and the
region keeps its bookkeeping for it (RegionBusyError naming the NIC; the region takes no new
write, grant or key meanwhile), and the next deregister finishes the job. The device's own
count of live MRs per NIC shows what is registered where at each step.
"""
from __future__ import annotations

import pytest

NICS = ["lo_a", "lo_b", "lo_c"]
SIZE = 12288  # the faulted MR's length: only this region's MRs hit the hook


@pytest.fixture
def transport():
    from pdkv._messenger import HAVE_VERBS

    if not HAVE_VERBS:
        pytest.skip("pdkv built without libibverbs")
    return "verbs"


def _mrs(p) -> dict:
    return {n: c[0] for n, c in p.device_objects(NICS).items()}


@pytest.mark.parametrize("isolate", [False, True])
def test_a_busy_nic_during_dereg_is_retried_and_nothing_stays_registered(spawn, connect, isolate):
    faults = f"dereg_busy_nic=3,dereg_busy_len={SIZE},dereg_busy_times=2"  # lo_c, twice
    a = spawn(1, env_extra={"PDKV_LOOPBACK_NICS": ",".join(NICS), "PDKV_LOOPBACK_FAULTS": faults},
              nics=NICS, isolate_peers=isolate)
    b = spawn(2, env_extra={"PDKV_LOOPBACK_NICS": ",".join(NICS)}, nics=NICS, isolate_peers=isolate)
    before = _mrs(a)
    a.alloc("src", SIZE, seed=7)
    b.alloc("dst", SIZE)
    key = a.register("src")
    rkey = b.m("grant", b.m("nic_key", b.register("dst"), 2), 1)  # lands through b's lo_c
    ca, _ = connect(a, b)
    k2 = a.m("nic_key", key, 2)
    a.m("write", ca, k2, 0, rkey, 0, SIZE, tag=1)
    assert [e[6] for e in a.wait("batch_done") if e[0] == "batch_done"] == [0]  # the region works, on lo_c
    assert b.read("dst") == a.read("src")
    registered = _mrs(a)
    assert all(registered[n] > before[n] for n in NICS), (before, registered)  # on every NIC
    for attempt in range(2):  # lo_c says busy twice
        with pytest.raises(Exception, match=r"RegionBusyError.*still registered on NIC\(s\) lo_c \(busy\).*no new writes"):
            a.m("deregister", key)
        # lo_a's and lo_b's MRs are gone, lo_c's is still there -- and still accounted for
        now = _mrs(a)
        assert {n: now[n] - before[n] for n in NICS} == {"lo_a": 0, "lo_b": 0, "lo_c": registered["lo_c"] - before["lo_c"]}
        # meanwhile the region takes nothing new, through any of its keys
        for k in (key, k2):
            with pytest.raises(Exception, match="being deregistered"):
                a.m("write", ca, k, 0, rkey, 0, 64, tag=2)
        with pytest.raises(Exception, match="being deregistered"):
            a.m("nic_key", key, 1)
    a.m("deregister", k2)  # the retry (through any of the region's keys) finishes the job
    assert _mrs(a) == before  # nothing left registered on any NIC
    with pytest.raises(Exception, match="unknown key"):
        a.m("deregister", key)  # and the region is forgotten


def test_a_busy_nic_during_revoke_keeps_the_grant_until_a_retry(spawn, connect):
    """The same hook on a narrow grant's MR (pdkv/disagg/grants.py retries busy revokes): the
    grant stays whole -- the peer's write through it still lands -- until the retried revoke
    takes it, after which the NIC refuses the write."""
    rng = 4096  # the faulted MR: the range, on lo_b
    b = spawn(2, env_extra={"PDKV_LOOPBACK_NICS": ",".join(NICS),
                            "PDKV_LOOPBACK_FAULTS": f"dereg_busy_nic=2,dereg_busy_len={rng}"},
              nics=NICS, isolate_peers=True)
    a = spawn(1, env_extra={"PDKV_LOOPBACK_NICS": ",".join(NICS)}, nics=NICS, isolate_peers=True)
    a.alloc("src", SIZE, seed=5)
    b.alloc("dst", SIZE)
    lkey = a.m("nic_key", a.register("src"), 1)
    key1 = b.m("nic_key", b.register("dst"), 1)
    wkey = b.m("grant_range", key1, 1, 0, rng)
    ca, _ = connect(a, b)
    with pytest.raises(Exception, match=r"RegionBusyError.*still in use by the device \(EBUSY\): revoke again"):
        b.m("revoke_range", key1, 1, 0, rng)
    a.m("write", ca, lkey, 0, wkey, 0, rng, imm=9, tag=1)  # still granted: it lands
    assert [e[6] for e in a.wait("batch_done") if e[0] == "batch_done"] == [0]
    b.wait_stat("imms", 1)
    assert b.read("dst", 0, rng) == a.read("src", 0, rng)
    b.m("revoke_range", key1, 1, 0, rng)  # the retry takes it
    a.m("write", ca, lkey, 0, wkey, 0, 64, imm=9, tag=2)
    done = [e[6] for e in a.wait("batch_done") if e[0] == "batch_done"]
    assert len(done) == 1 and done[0] != 0, done  # refused by the NIC now


def test_a_batch_queued_from_another_nics_key_holds_the_regions_dereg(spawn, connect):
    """The messenger core refuses to deregister a region that is the source of a batch queued
    on a layer counter; the batch may name the region's key on any NIC (rank r's pages leave
    through r's NIC), and the region's key on NIC 0 must still find it."""
    a = spawn(1, env_extra={"PDKV_LOOPBACK_NICS": ",".join(NICS)}, nics=NICS, isolate_peers=True)
    b = spawn(2, env_extra={"PDKV_LOOPBACK_NICS": ",".join(NICS)}, nics=NICS, isolate_peers=True)
    a.alloc("src", SIZE, seed=2)
    b.alloc("dst", SIZE)
    key = a.register("src")
    rkey = b.m("grant", b.m("nic_key", b.register("dst"), 1), 1)
    ca, _ = connect(a, b)
    watch = a.counter("layer")
    a.m("queue_pages", watch, 1, ca, a.m("nic_key", key, 1), rkey, [0], [0], seg_len=SIZE)  # waits for layer 1
    with pytest.raises(Exception, match="RegionBusyError.*source of a batch queued on counter"):
        a.m("deregister", key)
    a.bump("layer", 1)  # the batch goes out, then the region may go
    assert [e[6] for e in a.wait("batch_done") if e[0] == "batch_done"] == [0]
    assert b.read("dst") == a.read("src")
    a.m("deregister", key)


@pytest.mark.parametrize("busy_mr", ["grant", "local"])
def test_a_busy_per_peer_mr_during_dereg_keeps_the_region_dying_until_a_retry(spawn, connect, busy_mr):
    """With isolate_peers a region has an MR per peer (local, for our writes) and one per grant
    besides its own: ibv_dereg_mr of one of them saying EBUSY during the region's deregistration
    is not ignored. The busy MR stays registered (and accounted for), the region takes no new
    grant, and the next deregister finishes; only then is the grant's key refused by the NIC."""
    rng = 4096  # the narrow grant's MR: its length picks it out for the hook
    faults = {"grant": f"dereg_busy_nic=2,dereg_busy_len={rng}",
              # the region's own MR (the first of its length on lo_b) goes, its per-peer MR is busy
              "local": f"dereg_busy_nic=2,dereg_busy_len={SIZE},dereg_busy_skip=1"}[busy_mr]
    b = spawn(2, env_extra={"PDKV_LOOPBACK_NICS": ",".join(NICS), "PDKV_LOOPBACK_FAULTS": faults},
              nics=NICS, isolate_peers=True)
    a = spawn(1, env_extra={"PDKV_LOOPBACK_NICS": ",".join(NICS)}, nics=NICS, isolate_peers=True)
    a.alloc("src", SIZE, seed=3)
    b.alloc("dst", SIZE)
    lkey = a.m("nic_key", a.register("src"), 1)
    before = _mrs(b)
    key = b.register("dst")
    key1 = b.m("nic_key", key, 1)
    wkey = b.m("grant_range", key1, 1, 0, rng)
    ca, _ = connect(a, b)
    a.m("write", ca, lkey, 0, wkey, 0, rng, imm=3, tag=1)
    assert [e[6] for e in a.wait("batch_done") if e[0] == "batch_done"] == [0]
    b.m("revoke_range", key1, 1, 0, rng) if busy_mr == "local" else None  # only the local MR is left
    with pytest.raises(Exception, match=r"RegionBusyError.*still registered on NIC\(s\) lo_b \(busy\)"):
        b.m("deregister", key)
    now = _mrs(b)
    assert now["lo_a"] == before["lo_a"] and now["lo_c"] == before["lo_c"], (before, now)  # gone there
    assert now["lo_b"] == before["lo_b"] + 1, (before, now)  # the busy MR: still registered, still known
    with pytest.raises(Exception, match="being deregistered"):
        b.m("grant_range", key1, 1, 0, rng)
    b.m("deregister", key)  # the retry takes what was left
    assert _mrs(b) == before
    a.m("write", ca, lkey, 0, wkey, 0, 64, imm=3, tag=2)
    done = [e[6] for e in a.wait("batch_done") if e[0] == "batch_done"]
    assert len(done) == 1 and done[0] != 0, done  # the grant's key opens nothing any more


def test_the_longest_error_reaches_python_whole(spawn):
    """The longest C message: a region still registered on 16 busy NICs of 63-byte names (the
    messenger's error buffer held 160 bytes and cut it after the first name)."""
    names = [f"lo_{i:02d}_" + "n" * 57 for i in range(16)]
    a = spawn(1, env_extra={"PDKV_LOOPBACK_NICS": ",".join(names),
                            "PDKV_LOOPBACK_FAULTS": f"dereg_busy_nic=-1,dereg_busy_len={SIZE},dereg_busy_times=16"},
              nics=names, isolate_peers=True)
    a.alloc("src", SIZE)
    key = a.register("src")
    with pytest.raises(Exception) as info:
        a.m("deregister", key)
    msg = str(info.value)
    assert len(msg) > 1100 and "RegionBusyError" in msg, (len(msg), msg)
    assert ", ".join(names) + " (busy)" in msg and msg.rstrip("')\"").endswith("deregister it again to finish")
    a.m("deregister", key)
