"""libfabric's provider-key path (FI_MR_PROV_KEY, what EFA takes): a grant's key is the one the
provider gave its MR, and the writer aims through the region table the target sent with its
connection info. Run here through the stand-in (``fabric_table_keys``: keys drawn as a provider
would, on shm, which lets us choose them), the same code as with provider keys but the draw."""
from __future__ import annotations

import pytest
from fabrics import fabric_params

SIZE = 64 << 10
PAGE = 4096


@pytest.fixture(params=fabric_params(["shm"]))
def transport(request):  # overrides conftest's: these tests need a provider that takes virtual addresses
    return request.param


@pytest.fixture
def pair(spawn, connect):
    a, b = spawn(1, table_keys=True), spawn(2, table_keys=True)
    a.alloc("src", SIZE, seed=4)
    b.alloc("dst", SIZE)
    return a, b, a.register("src"), b.register("dst")


def _write(a, b, conn, lkey, key, roff, length, imm, timeout=5.0):
    """Did the write land (its immediate arrive within `timeout`)? Refusals are waited for
    briefly: the immediate of a refused write never comes."""
    b.m("expect", imm, 1)
    a.m("write", conn, lkey, 0, key, roff, length, imm=imm)
    return any(e[0] == "imm_done" for e in b.wait("imm_done", imm=imm, timeout=timeout))


def test_provider_keys_name_each_grant_and_nothing_else(pair, connect):
    a, b, lkey, region = pair
    whole = b.m("grant", region, 1)
    narrow_region = b.register("dst")  # a second key of the same memory: its own region
    narrow = b.m("grant_range", narrow_region, 1, 2 * PAGE, PAGE)
    assert whole != region and len({whole >> 32, narrow >> 32}) == 2  # per-MR provider keys
    ca, _ = connect(a, b)
    assert _write(a, b, ca, lkey, whole, 100, 300, imm=1)
    assert _write(a, b, ca, lkey, narrow, 2 * PAGE + 8, 64, imm=2)
    src = a.read("src", 0, 300)
    assert b.read("dst", 100, 300) == src and b.read("dst", 2 * PAGE + 8, 64) == src[:64]
    # across the range's end; then the region's own key, which opens nothing under provider keys
    assert not _write(a, b, ca, lkey, narrow, 3 * PAGE - 8, 64, imm=3, timeout=0.5)
    assert not _write(a, b, ca, lkey, region, 0, 64, imm=4, timeout=0.5)
    b.m("revoke", region, 1)
    assert not _write(a, b, ca, lkey, whole, 0, 64, imm=5, timeout=0.5)  # revoked: the MR is gone
    assert b.read("dst", 0, 100) == bytes(100) and b.read("dst", 3 * PAGE - 8, 8) == bytes(8)
    assert b.guards_ok("dst")
    # the domain's counts, as a verbs NIC's (/metrics): what landed at b, what a wrote
    (nb,), (na,) = b.m("nic_stats"), a.m("nic_stats")
    assert nb["name"] == na["name"] == "shm" and nb["imms"] == 2 and nb["imm_bytes"] == 364
    assert na["writes_done"] >= 2 and na["bytes_done"] >= 364 and na["qps"] == 1


def test_a_region_registered_after_the_connection_is_named(pair, connect):
    a, b, lkey, region = pair
    ca, _ = connect(a, b)
    b.alloc("late", SIZE)
    late = b.m("grant", b.register("late"), 1)  # not in the table the connection carries
    a.m("write", ca, lkey, 0, late, 0, 64, imm=6, tag=3)
    evs = a.wait("failed", timeout=5)
    assert any(e[0] == "batch_done" and e[6] == 1 and "names no region" in e[8] for e in evs), evs
    ca2, _ = connect(a, b)  # a new connection carries it
    assert _write(a, b, ca2, lkey, late, 0, 64, imm=7)


def test_provider_keys_need_virtual_addresses():
    from pdkv._messenger import HAVE_LIBFABRIC, Messenger, TransportUnavailableError
    from pdkv.transports import LibfabricOptions

    if not HAVE_LIBFABRIC:
        pytest.skip("pdkv built without libfabric")
    with pytest.raises(TransportUnavailableError, match="without FI_MR_VIRT_ADDR"):
        Messenger("libfabric", 1, LibfabricOptions(provider="tcp;ofi_rxm", domains=("lo",), table_keys=True))


@pytest.mark.parametrize("provider", ["sockets", "shm"])
def test_the_other_providers_enforce_grants_too(provider, spawn, connect):
    """tcp;ofi_rxm runs the whole grant suite (test_grants.py, test_bad_writes.py); here what
    docs/TRANSPORTS.md states of sockets and shm: a write outside its range, across its end or
    under another peer's key lands nothing, and the writer is told where the provider says so."""
    from fabrics import fabric_providers, refusal_reported

    if provider not in fabric_providers():
        pytest.skip(f"libfabric provider {provider} not available")
    a, c, b = (spawn(n, provider=provider, domains=["lo"] if provider == "sockets" else [])
               for n in (1, 3, 2))
    for w in (a, c):
        w.alloc("src", SIZE, seed=w.node_id)
    b.alloc("dst", SIZE)
    region = b.register("dst")
    key = b.m("grant_range", region, 1, 2 * PAGE, 2 * PAGE)
    ca, _ = connect(a, b)
    cc, _ = connect(c, b)
    lk_a, lk_c = a.register("src"), c.register("src")
    assert _write(a, b, ca, lk_a, key, 2 * PAGE, 128, imm=1)
    told = refusal_reported(f"libfabric:{provider}")[0]
    for w, conn, lk, roff, imm in ((a, ca, lk_a, PAGE, 2), (a, ca, lk_a, 4 * PAGE - 64, 3),
                                   (c, cc, lk_c, 2 * PAGE + 512, 4)):
        if w is a and imm == 3:
            ca, _ = connect(a, b)  # a refusal may have broken the connection
            conn = ca
        assert not _write(w, b, conn, lk, key, roff, 128, imm=imm, timeout=0.5)
        if told:
            assert any(e[0] == "error" or (e[0] == "batch_done" and e[6] > 0)
                       for e in w.wait("failed", timeout=5))
    dst = b.read("dst")
    assert dst[2 * PAGE:2 * PAGE + 128] == a.read("src", 0, 128)
    assert dst[:2 * PAGE] == bytes(2 * PAGE) and dst[2 * PAGE + 128:] == bytes(SIZE - 2 * PAGE - 128)


def test_provider_keys_name_their_device_over_two_domains(spawn, connect):
    """EFA's key path over several devices (one shm domain opened twice, "shm" and "shm@shm"): a
    grant on each of B's devices carries that device in its key, a write from A's device d to
    B's device d lands (each device counts its own), and the key of one device's grant aimed at
    the other device (its device bits rewritten by the writer) opens nothing there."""
    doms = ["shm", "shm@shm"]
    a, b = spawn(1, table_keys=True, domains=doms), spawn(2, table_keys=True, domains=doms)
    a.alloc("src", SIZE, seed=5)
    b.alloc("dst", SIZE)
    lkey, region = a.register("src"), b.register("dst")
    ca, _ = connect(a, b)
    keys = [b.m("grant_range", b.m("nic_key", region, d), 1, d * PAGE, PAGE) for d in (0, 1)]
    assert [(k >> 16) & 0xF for k in keys] == [0, 1] and len({k >> 32 for k in keys}) == 2
    for d, key in enumerate(keys):
        assert _write(a, b, ca, a.m("nic_key", lkey, d), key, d * PAGE, PAGE, imm=10 + d)
    assert [s["imms"] for s in b.m("nic_stats")] == [1, 1]
    assert [s["writes_done"] for s in a.m("nic_stats")] == [1, 1]
    assert b.read("dst")[:2 * PAGE] == a.read("src")[:PAGE] * 2  # each write: src's first page
    moved = keys[0] ^ (1 << 16)  # device 0's grant, named on device 1
    assert not _write(a, b, ca, a.m("nic_key", lkey, 1), moved, 0, PAGE, imm=20, timeout=2.0)
    assert [s["imms"] for s in b.m("nic_stats")] == [1, 1]
