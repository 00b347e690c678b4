"""The two disaggregation connectors' admission on their own (engine-thread side, no sockets):
what they ask the engine to reserve, the per-request rows they reserve at admission, and what
they tell their coordinator."""
from __future__ import annotations

import re
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from pdkv.config import DisaggConfig
from pdkv.disagg.choice import PeerRoute, PrefillChooser
from pdkv.disagg.decode_connector import DecodeConnector, HiddenRows
from pdkv.disagg.jobs import Job, JobTable
from pdkv.disagg.prefill_connector import PrefillConnector, StagingRows
from pdkv.engine.connector import LOCAL, NOT_YET, RESERVE, Verdict
from pdkv.engine.params import SamplingParams
from pdkv.engine.request import Request, RequestStatus


class FakeCoordinator:
    """FAKE (for these tests): records what the connector posts to the event loop; its chooser
    is the real one over one stand-in peer (``routable``: whether that peer is live)."""

    def __init__(self, routable=True, **disagg):
        self.posted, self.decisions, self.skipped = [], [], []
        self.peer = SimpleNamespace(dead=not routable, route=PeerRoute())
        dcfg = DisaggConfig(**{"local_prefill_max_tokens": 0, **disagg})
        self.chooser = PrefillChooser(dcfg, [self.peer], page_size=4, expiry_s=5.0)
        self.metrics = SimpleNamespace(queue_admission=SimpleNamespace(observe=lambda s: None),
                                       decided=self.decisions.append,
                                       transferred=lambda pages, skipped, writes: self.skipped.append(skipped))
        self.engine = SimpleNamespace(kv=SimpleNamespace(page_size=4))

    @property
    def routable(self):
        return not self.peer.dead

    @routable.setter
    def routable(self, value):
        self.peer.dead = not value

    def post(self, fn, *args):
        self.posted.append((fn.__name__, args))

    def send_prefill(self, *args):
        pass

    def client_aborted(self, rid):
        pass


def _req(rid, n):
    return Request(rid, list(range(1, n + 1)), SamplingParams(max_tokens=4), None)


def test_decode_connector_asks_for_remote_kv_and_reserves_a_hidden_row():
    coord = FakeCoordinator()
    conn = DecodeConnector(coord, HiddenRows(1))
    assert conn.admission(_req("one", 1)).num_external_tokens == 0  # nothing to compute remotely
    a, b = _req("a", 9), _req("b", 9)
    assert conn.admission(a).num_external_tokens == 8
    a.num_external_tokens, a.pages = 8, [3, 4]
    assert conn.admit(a) is RESERVE
    assert coord.posted == [("send_prefill", ("a", list(range(1, 9)), [3, 4], 0, coord.peer, 0, None))]
    b.num_external_tokens = 8
    assert conn.admit(b) is NOT_YET  # the only row is taken: b waits
    conn.rows.give_back(0)
    assert conn.admit(b) is RESERVE
    assert coord.peer.route.reserved == 16  # both picked for the one peer, not yet sent
    coord.routable = False
    c = _req("c", 5)
    assert conn.admission(c) is LOCAL  # no prefill node: prefilled here (disagg.local_fallback)
    assert conn.admit(c) is RESERVE
    assert [w.value for w in coord.decisions] == ["remote", "remote", "local_no_peer"]


def test_decode_connector_refuses_without_a_prefill_node_when_strict():
    coord = FakeCoordinator(routable=False, local_fallback=False)
    conn = DecodeConnector(coord, HiddenRows(1))
    answer = conn.admission(_req("c", 5))
    assert answer.verdict is Verdict.REFUSE
    assert re.search("no prefill node is connected.*local_fallback", answer.reason)
    assert answer.status == 503 and answer.retry_after == 2
    assert [w.value for w in coord.decisions] == ["refused_no_peer"]
    assert conn.admission(_req("one", 1)) is LOCAL  # a one-token prompt needs no prefill node


def test_decode_connector_waits_when_every_peer_died_after_admission():
    """Remote at admission, no live peer at admit: the row goes back and the request waits
    (its next admission decides again: local now)."""
    coord = FakeCoordinator()
    conn = DecodeConnector(coord, HiddenRows(1))
    a = _req("a", 9)
    assert conn.admission(a).num_external_tokens == 8
    coord.routable = False
    a.num_external_tokens, a.pages = 8, [3, 4]
    assert conn.admit(a) is NOT_YET and conn.rows.take() == 0 and not coord.posted
    conn.rows.give_back(0)
    assert conn.admission(_req("a", 9)) is LOCAL


def test_decode_connector_asks_only_for_what_its_prefix_cache_lacks():
    """The engine found 4 cached tokens (one page of 4): PREFILL names them and only the pages
    after them; a prompt cached up to its last token runs locally, even with no prefill node."""
    coord = FakeCoordinator()
    conn = DecodeConnector(coord, HiddenRows(2))
    a = _req("a", 11)
    a.num_cached_tokens = 4
    plan = conn.admission(a)
    assert plan.num_external_tokens == 6 and plan.reuse_cached is True
    a.num_external_tokens, a.pages = 6, [9, 3, 4]  # the cached page first, then the two to fill
    assert conn.admit(a) is RESERVE
    assert coord.posted == [("send_prefill", ("a", list(range(1, 11)), [3, 4], 0, coord.peer, 4, None))]
    coord.routable = False
    whole = _req("whole", 9)
    whole.num_cached_tokens = 8  # every page before the last token
    plan = conn.admission(whole)
    assert plan.num_external_tokens == 0 and not plan.prefill_only and coord.skipped == [2]
    assert conn.admit(whole) is RESERVE and len(coord.posted) == 1  # no PREFILL for it


@pytest.mark.parametrize("reason,told", [("abort", True), ("error", False)])
def test_decode_connector_tells_the_coordinator_only_of_clients_that_left(reason, told):
    coord = FakeCoordinator()
    conn = DecodeConnector(coord, HiddenRows(4))
    req = _req("a", 9)
    req.num_external_tokens = 8
    conn.admit(req)
    req.status, req.finish_reason = RequestStatus.ABORTED, reason
    conn.finished(req)
    conn.finished(req)  # once only
    assert [name for name, _ in coord.posted].count("client_aborted") == (1 if told else 0)
    local = _req("local", 1)
    local.status, local.finish_reason = RequestStatus.ABORTED, "abort"
    conn.finished(local)  # never went remote: nothing to cancel
    assert [name for name, _ in coord.posted].count("client_aborted") == (1 if told else 0)


def test_prefill_connector_is_prefill_only_and_reserves_a_staging_row():
    jobs = JobTable()
    for i, key in enumerate(("n:a", "n:b")):
        jobs.add(Job(key, key[2:], SimpleNamespace(dead=False), [1, 2, 3], np.zeros(1, dtype=np.int64), 1, 0, i, 0.0))
    kv = SimpleNamespace(geometry=SimpleNamespace(num_layers=2))
    staging = StagingRows(1, 8, torch.float32)
    conn = PrefillConnector(jobs, None, kv, None, 0, staging, 0, True, 4)
    assert conn.admission(_req("n:a", 3)).prefill_only
    assert conn.admit(_req("n:a", 3)) is RESERVE and jobs.get("n:a").staging == 0
    assert conn.admit(_req("n:b", 3)) is NOT_YET  # no staging row: waits instead of losing its hidden state
    staging.give_back(jobs.get("n:a").staging)
    assert conn.admit(_req("n:b", 3)) is RESERVE and jobs.get("n:b").staging == 0
