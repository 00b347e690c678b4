"""A decode node's list of prefill peers under discovery: a node that left for good gives its
place to the next newcomer, so a fleet whose prefill nodes come and go (new addresses each time,
as pods get them) keeps the list at the nodes registered at once, not every address ever seen."""
from __future__ import annotations

from pdkv.config import MessengerConfig
from pdkv.disagg.peers import PrefillPeers


def _peers() -> PrefillPeers:
    peers = PrefillPeers(MessengerConfig(), None, None, 0, lambda *a: None, lambda *a: None)
    peers._stopping = True  # no dialling here: only the list's bookkeeping is under test
    return peers


def test_a_gone_peer_gives_its_place_and_a_live_one_keeps_it():
    peers = _peers()
    a = peers.join("10.0.0.1", 7000)
    b = peers.join("10.0.0.2", 7000)
    assert peers.peers == [a, b]
    peers.leave("10.0.0.1", 7000, "lease ended")
    assert a.gone
    for i in range(50):  # churn: each newcomer takes the place of the one that left before it
        c = peers.join(f"10.0.1.{i}", 7000)
        assert len(peers.peers) == 2 and peers.peers[1] is b, i  # the live one keeps its index
        peers.leave(f"10.0.1.{i}", 7000, "lease ended")
    assert peers.join("10.0.0.2", 7000) is b  # an address already known is found, not added
    peers.join("10.0.9.9", 7000)
    peers.join("10.0.9.8", 7000)  # no gone place left: the list grows
    assert len(peers.peers) == 3 and not any(p.host == "10.0.0.1" for p in peers.peers)
    assert peers.chooser.peers is peers.peers  # the chooser reads the same list
