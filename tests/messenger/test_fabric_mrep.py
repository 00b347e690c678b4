"""FI_MR_ENDPOINT (pdkv/csrc/fabric_mrep.c) under the test double mrep_double.

No provider installed here demands the mode, so these run over a TEST DOUBLE: a DL provider
(fabric_mrep_provider.c, built by fabrics.py) wrapping tcp;ofi_rxm, whose MRs name nothing until
bound to an endpoint and enabled, and whose keys are scoped to that endpoint. The transport
suite runs over it too (fabrics.transport_params, test_multinic.py); here is what only it
shows: from the MR events it records, every key pdkv hands out or writes from is bound and
enabled first, a grant made before its endpoint is bound when the endpoint is made (again after
a reconnect), and a provider that refuses the binding fails the grant by name while the key
the peer would have had opens nothing.
"""
from __future__ import annotations

from pathlib import Path

import pytest
from fabrics import MREP_DOUBLE, fabric_params
from test_grants import _lands, _refused

SIZE = 64 << 10
PAGE = 4096
LOCAL_KEY = 1 << 62  # a region's local MR, region index 0 (FB_LKEY): the source of writes


@pytest.fixture(params=fabric_params([MREP_DOUBLE]))
def transport(request):
    return request.param


def _events(log: Path, peer) -> list[tuple[str, int]]:
    """(event, key) of the MRs of `peer`'s process, in order (the double's record)."""
    out = []
    for line in log.read_text().splitlines() if log.exists() else []:
        pid, kind, key = line.split()[:3]
        if int(pid) == peer.proc.pid:
            out.append((kind, int(key.removeprefix("key="), 16)))
    return out


def _of(log: Path, peer, key: int) -> list[str]:
    return [k for k, kk in _events(log, peer) if kk == key]


def test_every_key_is_bound_and_enabled_before_use_also_across_a_reconnect(spawn, connect, tmp_path):
    log = tmp_path / "mr.log"
    env = {"MREP_DOUBLE_LOG": str(log)}
    a, b = spawn(1, env), spawn(2, env)
    a.alloc("src", SIZE, seed=1)
    b.alloc("dst", SIZE)
    region = b.register("dst")
    early = b.m("grant_range", region, 1, 0, PAGE)  # no endpoint toward node 1 yet
    assert _of(log, b, early) == []  # nothing to bind to: no MR, the key opens nothing yet
    ca, cb = connect(a, b)
    late = b.m("grant_range", region, 1, PAGE, PAGE)
    assert _of(log, b, early) == ["bind", "enable"]  # bound when the endpoint was made
    assert _of(log, b, late) == ["bind", "enable"]  # bound to the endpoint there was
    want = _lands(a, b, ca, early, 0, 256, imm=1)
    # the writer's source, registered after its endpoint was made: bound to it at registration
    assert _of(log, a, LOCAL_KEY) == ["bind", "enable"]
    _lands(a, b, ca, late, PAGE, 256, imm=2)
    b.m("revoke_range", region, 1, PAGE, PAGE)
    assert _of(log, b, late) == ["bind", "enable", "close"]
    _refused(a, b, ca, late, PAGE, 256, imm=3, writer_id=1)
    assert b.read("dst", PAGE, PAGE) == want + bytes(PAGE - 256)  # only the landed write
    # a reconnect: the old endpoint's MRs close with it, the grant it outlived is bound to the
    # new endpoint before that endpoint's name goes out, and still admits its range
    a.m("disconnect", ca)
    b.m("disconnect", cb)
    assert _of(log, b, early) == ["bind", "enable", "close"]
    ca, _ = connect(a, b)
    assert _of(log, b, early) == ["bind", "enable", "close", "bind", "enable"]
    _lands(a, b, ca, early, 512, 256, imm=4)
    assert b.guards_ok("dst") and b.m("stats")["refused_writes"] == 0


def test_a_grant_the_provider_cannot_bind_fails_by_name_and_its_key_opens_nothing(spawn, connect, tmp_path):
    log = tmp_path / "mr.log"
    a = spawn(1)
    b = spawn(2, {"MREP_DOUBLE_LOG": str(log), "MREP_DOUBLE_FAULT": "bind_remote"})
    a.alloc("src", SIZE, seed=1)
    b.alloc("dst", SIZE)
    region = b.register("dst")
    ca, _ = connect(a, b)  # endpoints and local MRs bind; only MRs a peer may write are refused
    why = r"fi_mr_bind\(mr, ep\) on mrep_double: Function not implemented"
    with pytest.raises(Exception, match=why):
        b.m("grant", region, 1)
    with pytest.raises(Exception, match=why):
        b.m("grant_range", region, 1, 0, PAGE)
    with pytest.raises(Exception, match="holds no grant"):
        b.m("revoke", region, 1)  # nothing was left granted
    refused = [k for k, _ in _events(log, b) if k == "refused-bind"]
    assert len(refused) == 2 and _events(log, b).count(("close", region)) == 1  # freed once
    # the hostile peer writes with the key a whole-region grant is (the region's own key)
    _refused(a, b, ca, region, 0, 256, imm=5, writer_id=1)
    assert b.read("dst") == bytes(SIZE) and b.guards_ok("dst")


def test_endpoint_bound_mrs_with_provider_style_keys_are_refused_by_name(transport):
    """A grant carries one key; endpoint-bound MRs under provider-chosen keys would give it one
    per endpoint (the table_keys stand-in asks for that path)."""
    from pdkv._messenger import Messenger
    from pdkv.transports import LibfabricOptions

    with pytest.raises(Exception, match=r"binds MRs to endpoints \(FI_MR_ENDPOINT\) and table_keys"):
        Messenger("libfabric", 1, LibfabricOptions(provider=MREP_DOUBLE, domains=("lo",), table_keys=True))
