"""A remote request's Reservation (pdkv/disagg/reservation.py): one release, whatever the
ending. Alone over a stand-in memory (idempotent, revocation retried, what goes back and when),
then on a real pair over the FAKE transport: done, client gone, FAIL, timeout, peer death and
shutdown each release every reservation exactly once, and every pool is back afterwards."""

from __future__ import annotations

import collections
import threading
from types import SimpleNamespace

import pytest
from _cluster import Cluster, post_completion, wait_for

from pdkv.disagg.decode_memory import DecodeMemory
from pdkv.disagg.grants import Range
from pdkv.disagg.reservation import Reservation
from pdkv.disagg.rows import HiddenRows
from pdkv.server.app import NODE


class _Memory:
    """FAKE (stand-in for DecodeMemory): records what a reservation gives back, in order."""

    def __init__(self, busy_rounds=0, landing=True):
        self.events, self.later_calls, self.busy_rounds = [], [], busy_rounds
        self.rows = HiddenRows(2)
        self.rows.take()
        self.live, self.held = {}, {7: 3}
        self.landing = SimpleNamespace(release=lambda rid: self.events.append(("landing", rid))) if landing else None
        self.grants = SimpleNamespace(revoke=self._revoke)

    def _revoke(self, grantee, ranges):
        self.events.append(("revoke", grantee, len(ranges)))
        if self.busy_rounds:
            self.busy_rounds -= 1
            return ranges[:1]  # a write is landing in the first range right now
        return []

    def later(self, delay, fn, *args):
        self.later_calls.append(delay)
        fn(*args)

    def hold(self, grantee, n):
        self.held[grantee] += n

    def commands(self, cmd):
        self.events.append(("cmd", type(cmd).__name__, cmd.request_id))


def _granted(mem):
    res = Reservation("r", 0, mem)
    res.granted(7, (Range(1, 0, 8), Range(1, 8, 8), Range(2, 0, 8)))
    mem.live["r"] = res
    return res


def test_release_gives_everything_back_once_in_order():
    mem = _Memory()
    res, then = _granted(mem), []
    assert res.release(pages=True, then=lambda: then.append("ready")) is True
    assert mem.events == [("revoke", 7, 3), ("landing", "r"), ("cmd", "ReleasePages", "r")] and then == ["ready"]
    assert mem.held == {7: 0} and not mem.live and sorted(mem.rows._free) == [0, 1] and res.grants == ()
    assert res.release(pages=True) is False and res.release(pages=False) is False  # every later call: nothing
    assert len(mem.events) == 3 and sorted(mem.rows._free) == [0, 1] and res.releases == 3


def test_a_busy_range_is_retried_and_nothing_goes_back_before_it_is_gone():
    mem = _Memory(busy_rounds=2)
    res = _granted(mem)
    res.release(pages=True)
    assert [e for e in mem.events if e[0] == "revoke"] == [("revoke", 7, 3), ("revoke", 7, 1), ("revoke", 7, 1)]
    assert len(mem.later_calls) == 2  # retried twice, each after REVOKE_RETRY_S
    assert mem.events[3:] == [("landing", "r"), ("cmd", "ReleasePages", "r")]  # only once all were gone


def test_landed_keeps_the_landing_slots_and_the_engine_keeps_the_pages():
    mem = _Memory()
    res = _granted(mem)
    res.landed = True  # staged: the copy-in gives the landing slots back
    res.release(pages=False)
    assert mem.events == [("revoke", 7, 3)] and sorted(mem.rows._free) == [0, 1]


def test_grants_made_after_the_release_are_revoked_alone():
    mem = _Memory()
    res = Reservation("r", 0, mem)
    res.release(pages=False)  # the node stopped while the grant thread ran
    res.granted(7, (Range(1, 0, 8), Range(2, 0, 8)))
    assert mem.events == [("landing", "r"), ("revoke", 7, 2)] and mem.held == {7: 1} and res.grants == ()
    assert sorted(mem.rows._free) == [0, 1]  # the row went back once


def test_an_unsent_reservation_gives_its_row_back():
    mem = _Memory(landing=False)
    res = Reservation("r", 0, mem)  # the grants were never made
    assert res.release(pages=True) is True
    assert mem.events == [("cmd", "ReleasePages", "r")] and mem.held == {7: 3}


def test_reset_revokes_the_dead_peers_grants_and_keeps_the_rest_for_another():
    mem, again = _Memory(busy_rounds=1), []
    res = _granted(mem)
    assert res.reset(lambda: again.append(res.grants)) is True
    # revoked (one range busy: retried), nothing else went back, and only then the resend ran
    assert mem.events == [("revoke", 7, 3), ("revoke", 7, 1)] and again == [()] and mem.held == {7: 0}
    assert mem.live == {"r": res} and sorted(mem.rows._free) == [1] and not res.released
    res.granted(9, (Range(1, 0, 8),))  # another prefill node: granted the same pages afresh
    mem.held[9] = 1
    assert res.release(pages=True) is True
    assert mem.events[2:] == [("revoke", 9, 1), ("landing", "r"), ("cmd", "ReleasePages", "r")]
    assert mem.held == {7: 0, 9: 0} and sorted(mem.rows._free) == [0, 1] and res.resets == 1
    assert res.reset(lambda: again.append("no")) is False and again == [()]  # released: no reset


def test_a_release_during_a_reset_waits_for_its_revocation_and_then_gives_back_once():
    mem, again, pending = _Memory(busy_rounds=1), [], []
    mem.later = lambda delay, fn, *args: pending.append((fn, args))  # the retry runs when we say
    res = _granted(mem)
    res.reset(lambda: again.append("resend"))
    assert res.release(pages=True) is True and res.release(pages=True) is False  # the node stops
    assert mem.events == [("revoke", 7, 3)] and sorted(mem.rows._free) == [1]  # a write may land still
    fn, args = pending.pop()
    fn(*args)
    assert again == [] and mem.events[1:] == [("revoke", 7, 1), ("landing", "r"), ("cmd", "ReleasePages", "r")]
    assert sorted(mem.rows._free) == [0, 1] and not mem.live and mem.held == {7: 0}


# ---- on a real pair --------------------------------------------------------------------------------
DELAY = ("delay", 0, 0, 700_000)  # every prefill write lands 0.7 s late: each transfer is in flight a while


@pytest.fixture
def track(monkeypatch):
    """Every reservation made, and per request how many of its releases did something."""
    made, done = [], collections.Counter()
    reserve, release = DecodeMemory.reserve, Reservation.release

    def tracked_reserve(self, rid, row):
        res = reserve(self, rid, row)
        made.append(res)
        return res

    def tracked_release(self, pages, then=None):
        did = release(self, pages, then)
        done[self.rid] += int(did)
        return did
    monkeypatch.setattr(DecodeMemory, "reserve", tracked_reserve)
    monkeypatch.setattr(Reservation, "release", tracked_release)
    return SimpleNamespace(made=made, done=done)


def _settled(c, track, n):
    """``n`` reservations were made, each released exactly once, and nothing is left behind."""
    mem = c.coordinator.memory
    wait_for(lambda: len(track.made) == n and all(r.released for r in track.made) and not mem.live, 15,
             "every reservation released")
    assert all(r.releases == 1 for r in track.made), [(r.rid, r.releases) for r in track.made]
    assert set(track.done.values()) == {1} and len(track.done) == n
    assert len(mem.rows._free) == mem.rows.num_rows and not mem.held and not c.coordinator.slots


def _leave_mid_transfer(c, body):
    import json
    import socket

    host, port = c.url.removeprefix("http://").split(":")
    raw = json.dumps(body).encode()
    s = socket.create_connection((host, int(port)))
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              + f"Content-Length: {len(raw)}\r\n\r\n".encode() + raw)
    wait_for(lambda: c.coordinator.slots, 10, "its PREFILL sent")
    s.close()


def test_every_ending_releases_each_reservation_exactly_once(tiny_model_dir, track):
    # disagg.prefill_retries 0: the prefill node's death ends the request (with retries it is
    # prefilled here instead: tests/fleet/test_prefill_death.py)
    c = Cluster(tiny_model_dir, prefill_faults=[DELAY], prefill_over={"kv_cache__num_pages": 8},
                decode_over={"disagg__prefill_retries": 0})
    try:
        name = c.model_name()
        # done: the KV lands, the engine owns the pages from then on
        status, body = post_completion(c.url, {"model": name, "prompt": list(range(5, 14)), "max_tokens": 2})
        assert status == 200, body
        _settled(c, track, 1)
        # the client leaves mid-transfer: CANCEL, CANCEL_ACK{posted}, the posted writes land
        _leave_mid_transfer(c, {"model": name, "prompt": list(range(5, 20)), "max_tokens": 2})
        _settled(c, track, 2)
        # FAIL: the prefill pool (8 pages x 4 tokens) cannot hold a 40-token prompt
        status, body = post_completion(c.url, {"model": name, "prompt": list(range(5, 45)), "max_tokens": 2})
        assert status == 500 and "prefill node failed the request" in body["error"]["message"], body
        _settled(c, track, 3)
        # the transfer times out (its timer fired early, on the event loop, as the timer would)
        box = {}
        t = threading.Thread(target=lambda: box.setdefault("r", post_completion(
            c.url, {"model": name, "prompt": list(range(5, 18)), "max_tokens": 2})))
        t.start()
        wait_for(lambda: c.coordinator.slots, 10, "its PREFILL sent")
        slot = next(iter(c.coordinator.slots.values()))
        c.decode._loop.call_soon_threadsafe(c.coordinator._timeout, slot)
        t.join(30)
        assert box["r"][0] == 500 and "timed out" in box["r"][1]["error"]["message"], box
        _settled(c, track, 4)
        # the prefill node dies mid-transfer: 503, the data connection torn down, then the release
        t = threading.Thread(target=lambda: box.__setitem__("r", post_completion(
            c.url, {"model": name, "prompt": list(range(5, 18)), "max_tokens": 2})))
        t.start()
        wait_for(lambda: c.coordinator.slots, 10, "its PREFILL sent")
        c.prefill.stop()
        t.join(30)
        assert box["r"][0] == 503, box
        _settled(c, track, 5)
        assert c.decode_engine.allocator.num_free == c.decode_engine.allocator.num_total
    finally:
        c.stop()


def test_shutdown_releases_what_is_in_flight(tiny_model_dir, track):
    c = Cluster(tiny_model_dir, prefill_faults=[DELAY])
    try:
        name = c.model_name()
        t = threading.Thread(target=post_completion, args=(c.url, {"model": name, "prompt": list(range(5, 18)),
                                                                   "max_tokens": 2}))
        t.start()
        wait_for(lambda: c.coordinator.slots, 10, "its PREFILL sent")
        c.decode.stop()  # the engine loop first (it frees every page), then the coordinator
        t.join(30)
        assert len(track.made) == 1 and track.made[0].releases == 1 and not c.coordinator.memory.live
        mem = c.coordinator.memory
        assert len(mem.rows._free) == mem.rows.num_rows
        assert c.decode_engine.allocator.num_free == c.decode_engine.allocator.num_total
    finally:
        c.prefill.stop()


def test_a_dead_prefill_nodes_request_is_prefilled_here_and_released_once(tiny_model_dir, track):
    """The only prefill node dies mid-transfer (disagg.prefill_retries default, local_fallback):
    the request is computed here, its tokens those of an undisturbed run, its reservation
    released once (after the dead node's grants were revoked) and every page is back."""
    c = Cluster(tiny_model_dir, prefill_faults=[DELAY])
    try:
        body = {"model": c.model_name(), "prompt": list(range(5, 18)), "max_tokens": 6, "temperature": 0}
        box = {}
        t = threading.Thread(target=lambda: box.__setitem__("r", post_completion(c.url, body)))
        t.start()
        wait_for(lambda: c.coordinator.slots, 10, "its PREFILL sent")
        c.prefill.stop()
        t.join(30)
        _settled(c, track, 1)
        assert c.decode_engine.allocator.num_free == c.decode_engine.allocator.num_total
        m = c.coordinator.metrics
        assert m.prefill_retries.labels(*m._lab, "peer_dead", "local")._value.get() == 1
        want = post_completion(c.url, body)  # undisturbed (its prefix is cached here now: local)
        assert box["r"][0] == 200 and box["r"][1]["choices"][0]["text"] == want[1]["choices"][0]["text"], box
    finally:
        c.stop()
