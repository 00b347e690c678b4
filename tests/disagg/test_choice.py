"""The prefill chooser on its own (no sockets): where a prompt is prefilled, which prefill node
gets it by load and prefix affinity, and the heartbeat load it reads (malformed loads refused
with the field named)."""
from __future__ import annotations

import re
from types import SimpleNamespace

import pytest

from pdkv.config import DisaggConfig
from pdkv.disagg.choice import MAX_AFFINITY_ENTRIES, PeerRoute, PrefillChooser, Where, prefix_keys
from pdkv.disagg.jobs import Job, JobEnd, JobTable
from pdkv.disagg.load import PrefillLoad, measure_load, parse_load
from pdkv.disagg.metrics import WHERE

PS = 4  # page size


def _peers(n):
    return [SimpleNamespace(dead=False, route=PeerRoute(), name=f"p{i}") for i in range(n)]


def _chooser(n=2, **over):
    peers = _peers(n)
    cfg = DisaggConfig(**{"local_prefill_max_tokens": 8, "max_prefill_queue_tokens": 100, **over})
    return PrefillChooser(cfg, peers, PS, expiry_s=5.0), peers


def _load(queued=0, seen=0, free=1000):
    return PrefillLoad(queued_tokens=queued, running=0, waiting=0, free_pages=free, seen=seen)


def test_decide_short_saturated_no_peer_and_remote():
    ch, peers = _chooser()
    assert ch.decide(8) is Where.LOCAL_SHORT  # at the bound: short
    assert ch.decide(40, num_cached_tokens=32) is Where.LOCAL_SHORT  # the uncached part counts
    assert ch.decide(9) is Where.REMOTE
    assert ch.decide(1) is Where.LOCAL_SHORT
    ch.report(peers[0], _load(queued=100))
    assert ch.decide(40) is Where.REMOTE  # one node still has room
    ch.report(peers[1], _load(queued=150))
    assert ch.decide(40) is Where.LOCAL_SATURATED  # every live node at or above the bound
    peers[0].dead = peers[1].dead = True
    assert ch.decide(40) is Where.LOCAL_NO_PEER
    strict, sp = _chooser(local_fallback=False)
    sp[0].dead = sp[1].dead = True
    assert strict.decide(40) is Where.REFUSED_NO_PEER and strict.decide(3) is Where.LOCAL_SHORT
    zero, _ = _chooser(max_prefill_queue_tokens=0)
    assert zero.decide(40) is Where.LOCAL_SATURATED  # 0: an idle node is at the bound already
    unbounded, up = _chooser(max_prefill_queue_tokens=None)
    unbounded.report(up[0], _load(queued=10**9))
    unbounded.report(up[1], _load(queued=10**9))
    assert unbounded.decide(40) is Where.REMOTE


def test_only_the_uncached_part_of_a_prompt_is_local_prefill_work():
    """At the default disagg.local_prefill_max_tokens (128): a 2,000-token prompt with 1,984 of
    its tokens in this node's prefix cache is a 16-token prefill: here, even with every prefill
    node saturated or (strict) none connected, since it needs none; 1,856 cached leave 144: there."""
    ch, peers = _chooser(local_prefill_max_tokens=128)
    assert ch.decide(2000) is Where.REMOTE
    assert ch.decide(2000, num_cached_tokens=1984) is Where.LOCAL_SHORT
    assert ch.decide(2000, num_cached_tokens=1872) is Where.LOCAL_SHORT  # 128: at the bound
    assert ch.decide(2000, num_cached_tokens=1856) is Where.REMOTE
    for p in peers:
        ch.report(p, _load(queued=10**6))
    assert ch.decide(2000, num_cached_tokens=1984) is Where.LOCAL_SHORT  # not "saturated": short
    assert ch.decide(2000, num_cached_tokens=1856) is Where.LOCAL_SATURATED
    strict, sp = _chooser(local_prefill_max_tokens=128, local_fallback=False)
    for p in sp:
        p.dead = True
    assert strict.decide(2000, num_cached_tokens=1984) is Where.LOCAL_SHORT  # served during an outage
    assert strict.decide(2000, num_cached_tokens=1856) is Where.REFUSED_NO_PEER


def test_pick_least_loaded_by_report():
    ch, peers = _chooser(3)
    ch.report(peers[0], _load(queued=50))
    ch.report(peers[1], _load(queued=5))
    ch.report(peers[2], _load(queued=70))
    assert ch.pick(list(range(100, 110))) is peers[1]


def test_a_burst_between_heartbeats_spreads_and_seen_acknowledges_it():
    """p0 reported an empty queue, p1 15 tokens, and no report comes during the burst: each pick
    counts against its peer until a report covers it, so the burst alternates instead of piling
    onto the node that looked idle."""
    ch, peers = _chooser(2, affinity_pages=0)
    ch.report(peers[0], _load(queued=0))
    ch.report(peers[1], _load(queued=15))
    got = []
    for i in range(6):
        toks = list(range(i * 10, i * 10 + 20))
        p = ch.pick(toks)
        ch.sent(p, len(toks))
        got.append(p.name)
    assert got == ["p0", "p1"] * 3, got
    assert peers[0].route.queued(0, 1e9) == 60 and peers[0].route.reserved == 0
    # p0's report counts its first two PREFILLs: only the third is still added on top of it
    ch.report(peers[0], _load(queued=7, seen=2))
    assert peers[0].route.queued(0, 1e9) == 7 + 20
    ch.report(peers[0], _load(queued=7, seen=3))
    assert peers[0].route.queued(0, 1e9) == 7


def test_reserved_until_sent_and_unreserve():
    ch, peers = _chooser(2, affinity_pages=0)
    a = ch.pick(list(range(30)))
    assert a.route.reserved == 30
    b = ch.pick(list(range(30, 40)))
    assert b is not a  # a's reservation counts before its PREFILL left
    ch.unreserve(a, 30)
    assert a.route.reserved == 0 and a.route.num_routed == 0


def test_unreported_sends_expire_after_the_lease():
    peers = _peers(1)
    ch = PrefillChooser(DisaggConfig(), peers, PS, expiry_s=0.0)
    ch.sent(peers[0], 50)
    assert peers[0].route.queued(float("inf"), 0.0) == 0  # a peer that never reports does not look busy forever


def test_prefix_affinity_within_the_load_bound_only():
    ch, peers = _chooser(2, affinity_pages=2, affinity_max_extra_tokens=30)
    prefix = list(range(1000, 1008))  # two full pages
    first = ch.pick(prefix + [1, 2, 3])
    ch.sent(first, 11)
    other = peers[1] if first is peers[0] else peers[0]
    ch.report(first, _load(queued=25, seen=1))
    ch.report(other, _load(queued=0))
    assert ch.pick(prefix + [9, 9]) is first  # 25 <= 0 + 30: the node that has the prefix
    ch.unreserve(first, 10)
    ch.report(first, _load(queued=31, seen=1))
    assert ch.pick(prefix + [9, 9]) is other  # 31 > 0 + 30: load wins
    ch.unreserve(other, 10)
    ch.report(other, _load(queued=40))
    # the affinity moved with the last pick: now `other` holds the prefix
    assert ch.pick(prefix + [7]) is other
    # a saturated node loses its affinity to one with room
    ch2, p2 = _chooser(2, affinity_pages=1, affinity_max_extra_tokens=10**6)
    a = ch2.pick(prefix)
    ch2.report(a, _load(queued=100))
    assert ch2.pick(prefix) is not a


def test_affinity_off_and_affinity_map_bounded():
    ch, peers = _chooser(2, affinity_pages=0)
    assert prefix_keys(list(range(40)), PS, 0) == []
    ch, peers = _chooser(1, affinity_pages=1)
    for i in range(MAX_AFFINITY_ENTRIES + 50):
        ch.pick([i, i, i, i, 0])
        ch.unreserve(peers[0], 5)
    assert len(ch._affinity) == MAX_AFFINITY_ENTRIES


def test_prefix_keys_chain_over_full_pages():
    a = prefix_keys(list(range(13)), PS, 8)
    assert len(a) == 3  # 13 tokens: 3 full pages
    b = prefix_keys(list(range(8)) + [99, 10, 11, 12], PS, 8)
    assert a[:2] == b[:2] and a[2] != b[2]  # the same first two pages, a different third


def test_no_room_on_a_node_counts_against_it():
    ch, peers = _chooser(2, affinity_pages=0)
    ch.report(peers[0], _load(queued=0, free=1))  # one free page: no room for 40 tokens
    ch.report(peers[1], _load(queued=20, free=1000))
    assert ch.pick(list(range(40))) is peers[1]


def test_dead_peers_are_never_picked_and_reconnect_resets_the_count():
    ch, peers = _chooser(2, affinity_pages=0)
    peers[0].dead = True
    for _ in range(3):
        p = ch.pick(list(range(10)))
        assert p is peers[1]
        ch.sent(p, 10)
    peers[1].dead = True
    assert ch.pick(list(range(10))) is None
    ch.report(peers[1], _load(queued=5, seen=1))
    ch.connected(peers[1])  # a new channel: its reports count PREFILLs from zero
    r = peers[1].route
    assert r.report is None and r.num_sent == 0 and not r.sent and r.num_routed == 3


@pytest.mark.parametrize("load,field", [
    ([1, 2], "load must be a map"),
    ("busy", "load must be a map"),
    ({"queued_tokens": "lots"}, "load.queued_tokens"),
    ({"queued_tokens": -1}, "load.queued_tokens"),
    ({"queued_tokens": True}, "load.queued_tokens"),
    ({"free_pages": 2**63}, "load.free_pages"),
    ({"seen": 1.5}, "load.seen"),
    ({"running": None}, "load.running"),
])
def test_parse_load_names_the_bad_field(load, field):
    with pytest.raises(ValueError, match=field.replace(".", r"\.")):
        parse_load({"type": "HEARTBEAT", "load": load})


def test_parse_load_absent_partial_and_unknown_fields():
    assert parse_load({"type": "HEARTBEAT", "t": 1.0}) is None  # an older prefill node
    got = parse_load({"type": "HEARTBEAT", "load": {"queued_tokens": 7, "extra": "ignored"}})
    assert got == PrefillLoad(queued_tokens=7)
    assert parse_load({"load": _load(3, 4, 5).to_wire()}) == _load(3, 4, 5)


def test_measure_load_counts_what_is_left_to_compute():
    jobs = JobTable()
    for i, (n, done) in enumerate([(40, 0), (30, 16), (20, 20)]):
        j = Job(f"k{i}", f"r{i}", None, list(range(n)), None, i, 0, i, 0.0)
        j.num_computed = done
        jobs.add(j)
    jobs.engine_done("k2", JobEnd.PREFILLED)  # computed, its writes draining: nothing left to compute
    load = measure_load(jobs, {"num_pages_free": 9}, seen=3)
    assert load == PrefillLoad(queued_tokens=40 + 14, running=1, waiting=1, free_pages=9, seen=3)
    assert measure_load(JobTable(), None, 0) == PrefillLoad()


def test_metric_labels_are_the_decisions():
    assert set(WHERE) == {w.value for w in Where}


def test_ties_go_to_the_least_recently_picked():
    ch, peers = _chooser(3, affinity_pages=0)
    got = []
    for _ in range(6):
        p = ch.pick(list(range(10)))
        ch.unreserve(p, 10)  # equal queues every time
        got.append(p.name)
    assert got == ["p0", "p1", "p2", "p0", "p1", "p2"]


def test_a_peer_that_failed_is_tried_last_for_a_while():
    ch, peers = _chooser(2, affinity_pages=0)
    ch.report(peers[1], _load(queued=60))
    ch.failed(peers[0])
    assert ch.pick(list(range(10))) is peers[1]  # busier, but it did not just fail
    peers[1].dead = True
    assert ch.pick(list(range(10))) is peers[0]  # the only live one is still used
    later, lp = _chooser(2, affinity_pages=0)
    later.expiry_s = 0.0
    later.report(lp[1], _load(queued=60))
    later.failed(lp[0])
    assert later.pick(list(range(10))) is lp[0]  # the failure is old: load decides again


@pytest.mark.parametrize("field,value,says", [
    ("local_prefill_max_tokens", -1, "zero or a positive number of prompt tokens"),
    ("max_prefill_queue_tokens", -5, "null (no bound) or zero or a positive number"),
    ("affinity_pages", 65, "an integer in [0, 64]"),
    ("affinity_max_extra_tokens", -1, "zero or a positive number of queued prompt tokens"),
    ("local_prefill_max_tokens", "many", "must be an integer"),
    ("local_fallback", "perhaps", "must be"),
])
def test_bad_disagg_config_names_the_field(field, value, says):
    from pdkv.config import ConfigError, config_from_dict, load_config

    with pytest.raises(ConfigError, match=rf"disagg\.{field} .*{re.escape(says)}"):
        config_from_dict({"role": "decode", "messenger": {"prefill_peers": ["127.0.0.1:7100"]},
                          "disagg": {field: value}})
    if not isinstance(value, str):
        with pytest.raises(ConfigError, match=rf"--set disagg\.{field}={value}: disagg\.{field} must"):
            load_config("configs/decode.yaml", [f"disagg.{field}={value}"])
    with pytest.raises(ConfigError, match=r"unknown field 'disagg\.local_prefil'"):
        load_config("configs/decode.yaml", ["disagg.local_prefil=3"])


@pytest.mark.parametrize("why", ["failed", "no_room"])
def test_an_affinity_holder_that_failed_or_has_no_room_loses_within_the_load_bound(why):
    """Affinity only breaks ties in load: the node that holds the prefix but just failed (or
    has no room for the prompt) loses to another node even while its queue is within
    affinity_max_extra_tokens of that node's."""
    ch, peers = _chooser(2, affinity_pages=2, affinity_max_extra_tokens=1000)
    prefix = list(range(1000, 1008))
    holder = ch.pick(prefix + [1, 2])
    ch.unreserve(holder, 10)
    other = peers[1] if holder is peers[0] else peers[0]
    ch.report(other, _load(queued=5))
    assert ch.pick(prefix + [3]) is holder  # both fine: 0 <= 5 + 1000, affinity holds
    ch.unreserve(holder, 9)
    if why == "failed":
        ch.failed(holder)
    else:
        ch.report(holder, _load(queued=0, free=2))  # 2 pages = 8 tokens < 9
    assert ch.pick(prefix + [3]) is other


def test_room_is_judged_in_tokens_against_pages():
    """free_pages counts pages, the prompt tokens: 3 free pages of 4 hold a 12-token prompt
    (room), not a 13-token one; compared as if both were tokens, 3 < 12 would say no room."""
    ch, peers = _chooser(2, affinity_pages=0)
    ch.report(peers[0], _load(queued=0, free=3))
    ch.report(peers[1], _load(queued=50, free=1000))
    assert ch.pick(list(range(12))) is peers[0]  # 3 * 4 = 12 >= 12
    ch.unreserve(peers[0], 12)
    assert ch.pick(list(range(13))) is peers[1]  # 12 < 13: no room


def test_affinity_holds_at_exactly_the_extra_token_bound():
    ch, peers = _chooser(2, affinity_pages=1, affinity_max_extra_tokens=30)
    prefix = list(range(1000, 1004))
    holder = ch.pick(prefix + [1])
    ch.unreserve(holder, 5)
    other = peers[1] if holder is peers[0] else peers[0]
    ch.report(holder, _load(queued=30))
    ch.report(other, _load(queued=0))
    assert ch.pick(prefix + [2]) is holder  # 30 == 0 + 30: still within
    ch.unreserve(holder, 5)
    ch.report(holder, _load(queued=31))
    assert ch.pick(prefix + [2]) is other  # one token past it
