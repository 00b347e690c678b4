"""libfabric device memory (Messenger.register_device: FI_HMEM, what EFA offers for GPU memory),
through its CPU stand-in: ``hmem_system`` registers host memory through the very calls GPU
memory takes (fi_mr_regattr naming the memory's iface; every MR of the region -- its local MR
in each peer's domain, whole and narrow grants -- registered the same way), on a provider that
declares FI_HMEM (shm here). A provider without FI_HMEM refuses with the fix; a dma-buf needs
libfabric >= 1.20 and the refusal of it says so (then the device pointer is taken)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from fabrics import fabric_params

ROOT = Path(__file__).resolve().parents[2]

CHILD = r"""
import json, os, select, sys, time
import numpy as np
from pdkv._messenger import Messenger, MessengerError, TransportUnavailableError
from pdkv.transports import LibfabricOptions

prov = sys.argv[1]
doms = ("lo",) if prov in ("tcp;ofi_rxm", "sockets") else ()
out = {}
try:
    Messenger("libfabric", 9, LibfabricOptions(provider=prov, domains=doms, hmem_system=True)).close()
except TransportUnavailableError as e:
    out["no_hmem"] = str(e)
    m = Messenger("libfabric", 9, LibfabricOptions(provider=prov, domains=doms))
    buf = np.zeros(4096, np.uint8)
    try:
        m.register_device(-1, 0, buf.nbytes, buf.ctypes.data)
        out["plain"] = "registered"
    except TransportUnavailableError as e:
        out["plain"] = str(e)
    m.close()
    print(json.dumps(out))
    sys.exit(0)

opts = LibfabricOptions(provider=prov, domains=doms, hmem_system=True)
a, b = Messenger("libfabric", 1, opts), Messenger("libfabric", 2, opts)
src = np.random.default_rng(1).integers(0, 255, 1 << 16, dtype=np.uint8)
dst = np.zeros(1 << 16, dtype=np.uint8)
fd = os.memfd_create("not-a-dmabuf")
os.ftruncate(fd, dst.nbytes)
lkey, out["src_how"] = a.register_device(-1, 0, src.nbytes, src.ctypes.data)
try:  # a dma-buf fd first: these headers have no FI_MR_DMABUF, or the fd is no dma-buf
    bkey, out["dst_how"] = b.register_device(fd, 0, dst.nbytes, dst.ctypes.data)
except MessengerError as e:
    out["dst_err"] = str(e)
    bkey, out["dst_how"] = b.register_device(-1, 0, dst.nbytes, dst.ctypes.data)
os.close(fd)
rkey = b.grant_range(bkey, 1, 4096, 8192)
ca, ia = a.prepare(2)
cb, ib = b.prepare(1)
a.complete(ca, ib)
b.complete(cb, ia)
b.expect(7, 1)
a.write(ca, lkey, 100, rkey, 4096, 8192, imm=7)

def wait(m, kind):
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        select.select([m.fileno()], [], [], 0.5)
        for ev in m.drain():
            if ev.kind in (kind, "error"):
                return ev.kind
    return "timeout"

out["landed"] = wait(b, "imm_done")
out["written"] = wait(a, "batch_done")
out["equal"] = bool((dst[4096:4096 + 8192] == src[100:100 + 8192]).all())
out["rest_zero"] = bool(not dst[:4096].any() and not dst[4096 + 8192:].any())
b.revoke_range(bkey, 1, 4096, 8192)
a.disconnect(ca)
b.disconnect(cb)
a.deregister(lkey)
b.deregister(bkey)
a.close()
b.close()
print(json.dumps(out))
"""


def run_child(provider: str) -> dict:
    r = subprocess.run([sys.executable, "-c", CHILD, provider], capture_output=True, text=True, timeout=120,
                       cwd=str(ROOT))
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("transport", fabric_params(["shm"]))
def test_device_memory_path_through_the_system_memory_stand_in(transport):
    got = run_child(transport.split(":", 1)[1])
    assert "no_hmem" not in got, got  # shm declares FI_HMEM here
    assert got["src_how"] == "hmem" and got["dst_how"] == "hmem", got
    # a memfd is no dma-buf (and these headers may predate FI_MR_DMABUF): the pointer was taken
    assert "dst_err" not in got or "dma-buf" in got["dst_err"], got
    assert got["landed"] == "imm_done" and got["written"] == "batch_done", got
    assert got["equal"] and got["rest_zero"], got  # byte-exact, only inside the grant


@pytest.mark.parametrize("transport", fabric_params(["tcp;ofi_rxm", "sockets"]))
def test_a_provider_without_hmem_refuses_device_memory_with_the_fix(transport):
    got = run_child(transport.split(":", 1)[1])
    if "no_hmem" not in got:
        pytest.skip(f"{transport} declares FI_HMEM here")
    assert "has no FI_HMEM" in got["no_hmem"], got
    assert "does not register device memory" in got["plain"] and "messenger.staging auto" in got["plain"], got


@pytest.mark.parametrize("transport", fabric_params(["shm"]))
def test_device_memory_is_asked_for(transport):
    """Without device_memory the plain hints are used (FI_HMEM would change the provider's
    protocols for every write) and register_device says what to ask for."""
    r = subprocess.run([sys.executable, "-c", NOT_ASKED], capture_output=True, text=True, timeout=60, cwd=str(ROOT))
    assert r.returncode == 0, r.stderr[-2000:]
    assert "made without device_memory" in r.stdout and "messenger.staging auto" in r.stdout, r.stdout


NOT_ASKED = r"""
import numpy as np
from pdkv._messenger import Messenger, TransportUnavailableError
from pdkv.transports import LibfabricOptions
m = Messenger("libfabric", 1, LibfabricOptions(provider="shm"))
buf = np.zeros(4096, np.uint8)
try:
    m.register_device(-1, 0, buf.nbytes, buf.ctypes.data)
    print("registered")
except TransportUnavailableError as e:
    print(e)
m.close()
"""
