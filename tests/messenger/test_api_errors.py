"""Bad input to the Messenger API is a clear, typed error that names what was wrong."""
from __future__ import annotations

import numpy as np
import pytest

from pdkv._messenger import (HAVE_VERBS, InvalidRequestError, Messenger, MessengerError,
                             PeerConnectionError, TransportUnavailableError, transports)


def test_unknown_transport_and_bad_options():
    with pytest.raises(InvalidRequestError, match="unknown transport 'udp'"):
        Messenger("udp", 1)
    with pytest.raises(InvalidRequestError, match="port"):
        Messenger("tcp", 1, port=70000)
    with pytest.raises(InvalidRequestError, match="num_streams"):
        Messenger("tcp", 1, num_streams=0)
    with pytest.raises(TransportUnavailableError, match="not a numeric IP"):
        Messenger("tcp", 1, host="not-an-ip")
    assert "tcp" in transports() and "fake" in transports()


@pytest.mark.skipif(not HAVE_VERBS, reason="built without libibverbs")
def test_verbs_without_a_device_is_an_error_never_tcp():
    # this process loads the system's libibverbs, and this machine has no RDMA device
    with pytest.raises(TransportUnavailableError, match="verbs") as ei:
        Messenger("verbs", 1, nics=["mlx5_0"])
    assert "tcp" not in type(ei.value).__name__
    with pytest.raises(TransportUnavailableError, match="auto"):
        Messenger("verbs", 1, nics=["auto"])


def test_bad_calls_name_the_problem():
    m = Messenger("tcp", 1)
    buf = np.zeros(4096, dtype=np.uint8)
    key = m.register(buf)
    with pytest.raises(InvalidRequestError, match="non-zero length"):
        m.register(np.zeros(0, dtype=np.uint8))
    with pytest.raises(InvalidRequestError, match="unknown region"):
        m.grant(key + 1, 2)
    conn, info = m.prepare(2)
    with pytest.raises(InvalidRequestError, match="bytes"):
        m.complete(conn, b"short")
    with pytest.raises(PeerConnectionError, match="not complete"):
        m.write(conn, key, 0, 1, 0, 16)
    with pytest.raises(InvalidRequestError, match="unknown connection"):
        m.write(99, key, 0, 1, 0, 16)
    with pytest.raises(InvalidRequestError, match="from node 1"):
        m.complete(conn, info)  # our own info: it names node 1, the connection is for node 2
    with pytest.raises(InvalidRequestError, match="3 pages"):
        m.write_pages(conn, key, 1, [0, 1, 2], [0], seg_len=8)
    with pytest.raises(InvalidRequestError, match="32-bit"):
        m.write_pages(conn, key, 1, [0], [0], seg_len=8, imm=2**32)
    with pytest.raises(InvalidRequestError, match="num_segs"):
        m.write_pages(conn, key, 1, [0], [0], seg_len=8, num_segs=0)
    m.expect(5, 3)
    with pytest.raises(InvalidRequestError, match="already expected"):
        m.expect(5, 4)
    assert m.forget(5) == 0 and m.forget(5) == 0
    counters = np.zeros(2, dtype=np.int64)
    with pytest.raises(InvalidRequestError, match="index 2"):
        m.watch(counters, 2)
    with pytest.raises(InvalidRequestError, match="aligned"):
        m.watch_address(counters.ctypes.data + 4)
    with pytest.raises(InvalidRequestError, match="unknown watch"):
        m.queue_pages(7, 1, conn, key, 1, [0], [0], seg_len=8)
    with pytest.raises(InvalidRequestError, match="only on the fake"):
        m.add_fault("drop", 0)
    m.deregister(key)
    with pytest.raises(InvalidRequestError, match="unknown region"):
        m.deregister(key)  # a stale key never names anything again
    m.close()
    m.close()
    with pytest.raises(MessengerError, match="closed"):
        m.drain()


def test_close_while_other_threads_are_calling_in():
    """close() waits for calls that released the GIL; later calls get a clear error, no crash."""
    import threading

    a, b = Messenger("fake", 1), Messenger("fake", 2)
    src, dst = np.ones(1 << 16, dtype=np.uint8), np.zeros(1 << 16, dtype=np.uint8)
    lkey, rkey = a.register(src), b.register(dst)
    b.grant(rkey, 1)
    ca, ia = a.prepare(2)
    cb, ib = b.prepare(1)
    a.complete(ca, ib)
    b.complete(cb, ia)
    errors: list = []

    def hammer():
        try:
            while True:
                a.write_pages(ca, lkey, rkey, list(range(16)), list(range(16)), seg_len=4096,
                              src_page_stride=4096, dst_page_stride=4096, imm=1)
                a.drain()
        except MessengerError as e:
            errors.append(e)

    threads = [threading.Thread(target=hammer) for _ in range(3)]
    for t in threads:
        t.start()
    import time

    time.sleep(0.1)
    a.close()
    for t in threads:
        t.join(5)
    assert not any(t.is_alive() for t in threads)
    assert len(errors) == 3 and all("closed" in str(e) for e in errors)
    b.close()


def test_poller_pins_to_the_given_cpus():
    import glob
    import os

    def pinned_to_cpu0() -> int:
        n = 0
        for status in glob.glob(f"/proc/{os.getpid()}/task/*/status"):
            with open(status) as f:
                n += any(ln.split(":")[1].strip() == "0" for ln in f if ln.startswith("Cpus_allowed_list"))
        return n

    before = pinned_to_cpu0()
    with Messenger("fake", 1, cpus=[0]):
        assert pinned_to_cpu0() == before + 1  # the poller thread, and only it
    assert pinned_to_cpu0() == before
