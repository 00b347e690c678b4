"""Bad input to the Messenger API is a clear, typed error that names what was wrong."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from fabrics import fabric_params
from pdkv._messenger import (HAVE_LIBFABRIC, HAVE_VERBS, InvalidRequestError, Messenger, MessengerError,
                             PeerConnectionError, TransportUnavailableError, transports)
from pdkv.transports import Capability, FakeOptions, LibfabricOptions, TcpOptions, VerbsOptions


def test_unknown_transport_and_bad_options():
    with pytest.raises(InvalidRequestError, match="unknown transport 'udp'"):
        Messenger("udp", 1)
    with pytest.raises(InvalidRequestError, match="port"):
        Messenger("tcp", 1, TcpOptions(port=70000))
    with pytest.raises(InvalidRequestError, match="num_streams"):
        Messenger("tcp", 1, TcpOptions(num_streams=0))
    with pytest.raises(TransportUnavailableError, match="not a numeric IP"):
        Messenger("tcp", 1, TcpOptions(host="not-an-ip"))
    assert "tcp" in transports() and "fake" in transports()
    with pytest.raises(InvalidRequestError, match="takes TcpOptions options"):
        Messenger("tcp", 1, VerbsOptions())  # another transport's options: named, never ignored
    with pytest.raises(InvalidRequestError, match="takes FakeOptions options"):
        Messenger("fake", 1, {"host": "127.0.0.1"})
    m = Messenger("tcp", 1, TcpOptions(num_streams=1))
    assert m.options == TcpOptions(num_streams=1) and Capability.SEALED_STREAMS in m.capabilities
    m.close()
    assert Messenger("fake", 1).options == FakeOptions()  # None: the transport's defaults


@pytest.mark.skipif(not HAVE_LIBFABRIC, reason="built without libfabric")
def test_libfabric_names_a_missing_provider_or_domain():
    """A provider libfabric lacks, or a domain the provider lacks, is a clear error naming it
    (never another transport); the config's choices are checked before (pdkv.config)."""
    with pytest.raises(TransportUnavailableError, match="provider 'psm2' is not available here"):
        Messenger("libfabric", 1, LibfabricOptions(provider="psm2"))
    with pytest.raises(TransportUnavailableError, match="has no domain 'nodev0'"):
        Messenger("libfabric", 1, LibfabricOptions(provider="tcp;ofi_rxm", domains=("nodev0",)))
    with pytest.raises(TransportUnavailableError, match="domain 'lo' is named twice"):
        Messenger("libfabric", 1, LibfabricOptions(provider="tcp;ofi_rxm", domains=("lo", "lo")))
    with pytest.raises(TransportUnavailableError, match=r"has no domain 'lo@10.0.0.0/8'"):
        Messenger("libfabric", 1, LibfabricOptions(provider="tcp;ofi_rxm", domains=("lo@10.0.0.0/8",)))
    with pytest.raises(InvalidRequestError, match="at most 16 fabric domains, got 17"):
        Messenger("libfabric", 1, LibfabricOptions(provider="tcp;ofi_rxm", domains=tuple(f"d{i}" for i in range(17))))
    m = Messenger("libfabric", 1, LibfabricOptions(provider="tcp;ofi_rxm", domains=("lo",)))
    with pytest.raises(InvalidRequestError, match="connection info of 3 bytes"):
        m.complete(m.prepare(2)[0], b"abc")
    with pytest.raises(PeerConnectionError, match="not connected"):
        m.write(m.prepare(2)[0], m.register(bytearray(64)), 0, 1, 0, 8)
    with pytest.raises(InvalidRequestError, match="unknown key"):
        m.grant(12345, 2)
    m.close()
    assert "libfabric" in transports()


def host_rdma_devices() -> list[str]:
    root = "/sys/class/infiniband"
    return sorted(os.listdir(root)) if os.path.isdir(root) else []


@pytest.mark.skipif(not HAVE_VERBS, reason="built without libibverbs")
def test_verbs_with_a_missing_nic_is_an_error_never_tcp():
    """This process loads the system's libibverbs: a NIC no host has is named in the error,
    with the devices this host has -- or the statement that it has none; never tcp."""
    bogus = "pdkv_no_such_nic9"
    with pytest.raises(TransportUnavailableError, match="verbs") as ei:
        Messenger("verbs", 1, VerbsOptions(nics=(bogus,)))
    msg = str(ei.value)
    assert "tcp" not in type(ei.value).__name__
    rdma = host_rdma_devices()
    if rdma:
        assert f"NIC '{bogus}' not found; available:" in msg and all(n in msg for n in rdma), msg
    else:
        assert "no RDMA device" in msg, msg
    # "auto" is resolved by pdkv.messenger from the topology; the transport itself refuses it
    # on every host
    with pytest.raises(TransportUnavailableError, match="'auto' must be resolved"):
        Messenger("verbs", 1, VerbsOptions(nics=("auto",)))


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


CLOSE_RACE = r"""
import json, sys, threading, time
import numpy as np
from pdkv._messenger import Messenger, MessengerError
from pdkv.transports import LibfabricOptions, VerbsOptions

transport, _, provider = sys.argv[1].partition(":")
opts = (VerbsOptions(nics=("lo_verbs0",)) if transport == "verbs" else
        LibfabricOptions(provider=provider, domains=("lo",)) if transport == "libfabric" else None)
a, b = Messenger(transport, 1, opts), Messenger(transport, 2, opts)
src, dst = np.ones(1 << 16, dtype=np.uint8), np.zeros(1 << 16, dtype=np.uint8)
lkey, rkey = a.register(src), b.register(dst)
b.grant(rkey, 1)
ca, ia = a.prepare(2)
cb, ib = b.prepare(1)
a.complete(ca, ib)
b.complete(cb, ia)
errors, calls = [], [0, 0, 0]

def hammer(i):
    try:
        while True:
            a.write_pages(ca, lkey, rkey, list(range(16)), list(range(16)), seg_len=4096,
                          src_page_stride=4096, dst_page_stride=4096, imm=1)
            a.drain()
            calls[i] += 1
    except MessengerError as e:
        errors.append(str(e))

threads = [threading.Thread(target=hammer, args=(i,)) for i in range(3)]
for t in threads:
    t.start()
deadline = time.monotonic() + 30  # close only once every thread is calling in (a hang guard)
while min(calls) < 20 and time.monotonic() < deadline and not errors:
    time.sleep(0.001)
before = list(calls)
a.close()
for t in threads:
    t.join(10)
try:
    a.drain()
    after = "no error"
except MessengerError as e:
    after = str(e)
b.close()
print(json.dumps({"alive": sum(t.is_alive() for t in threads), "errors": errors, "before": before,
                  "after": after}))
"""

CLOSE_TRANSPORTS = ["fake", "tcp", "shm", "auto", pytest.param("verbs", marks=pytest.mark.skipif(
    not HAVE_VERBS and os.environ.get("PDKV_REQUIRE_VERBS") != "1", reason="pdkv built without libibverbs")),
    *fabric_params(["tcp;ofi_rxm"])]


@pytest.mark.parametrize("transport", CLOSE_TRANSPORTS)
def test_close_while_other_threads_are_calling_in(transport, request):
    """close() waits for calls that released the GIL; later calls get a clear error, no crash,
    on every transport. In a child process: a crash there is a failed test, not a dead session,
    and the verbs run loads the loopback device, which this process must not."""
    env = {k: v for k, v in os.environ.items() if k != "LD_LIBRARY_PATH"}
    if transport == "verbs":
        env["LD_LIBRARY_PATH"] = request.getfixturevalue("loopback_verbs_dir")
    proc = subprocess.run([sys.executable, "-c", CLOSE_RACE, transport], env=env, capture_output=True,
                          text=True, timeout=120, cwd=str(Path(__file__).resolve().parents[2]))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    assert min(r["before"]) >= 20, r  # every thread was calling in when close() ran
    assert r["alive"] == 0, r
    assert len(r["errors"]) == 3 and all("closed" in e for e in r["errors"]), r
    assert "closed" in r["after"], r


def test_poller_pins_to_the_given_cpus():
    import glob
    import os

    def pinned_to_cpu0() -> int:
        n = 0
        for status in glob.glob(f"/proc/{os.getpid()}/task/*/status"):
            try:
                with open(status) as f:
                    n += any(ln.split(":")[1].strip() == "0" for ln in f if ln.startswith("Cpus_allowed_list"))
            except FileNotFoundError:  # a thread (not the poller) ended between the glob and the open
                continue
        return n

    before = pinned_to_cpu0()
    with Messenger("fake", 1, cpus=[0]):
        assert pinned_to_cpu0() == before + 1  # the poller thread, and only it
    assert pinned_to_cpu0() == before
