"""Lifecycle on the FAKE in-process transport (fault injection: delayed writes): a client that
leaves mid-transfer or mid-decode, a transfer timeout, a prefill FAIL. Each ends with a clear
error (or abort) for that client only, other requests finish, and both page pools return to
their start -- after the quarantine: never while a write can still land."""
from __future__ import annotations

import json
import socket
import threading
import urllib.error
import urllib.request

import functools

from pdkv.server.app import NODE

from _cluster import Cluster, colocated_tokens, post_completion as _post, wait_for

DELAY = ("delay", 0, 0, 700_000)  # every prefill write lands 0.7 s late


@functools.lru_cache(maxsize=None)
def _want(model_dir, prompt: tuple, max_tokens: int) -> list[int]:
    return colocated_tokens(model_dir, list(prompt), max_tokens)


def _greedy(name, prompt, max_tokens=4):
    """A request whose answer is compared token by token with the colocated engine's."""
    return {"model": name, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True}


def _tokens(result):
    status, body = result
    assert status == 200, body
    return body["choices"][0]["token_ids"]


def _in_thread(fn, *args):
    box = {}
    t = threading.Thread(target=lambda: box.setdefault("r", fn(*args)))
    t.start()
    return t, box


def _send_and_leave(url, body, leave_when):
    """A client that sends a request and closes its socket once ``leave_when()`` holds."""
    host, port = url.removeprefix("http://").split(":")
    raw = json.dumps(body).encode()
    s = socket.create_connection((host, int(port)))
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              + f"Content-Length: {len(raw)}\r\n\r\n".encode() + raw)
    wait_for(leave_when, 10, "the moment to leave")
    s.close()


def test_client_leaves_mid_transfer_pages_wait_for_the_writes(tiny_model_dir):
    """A client leaves while its KV is in flight (FAKE DELAY: its 17 writes land 0.7 s late, later
    writes at once). A request sent while those writes can still land needs the leaver's pages
    (the decode pool has 10: the leaver holds 8, it needs 6): it waits, gets them only after the
    writes landed, and answers exactly the colocated tokens."""
    leaver_writes = 8 * 2 + 1  # 29 tokens of KV: 8 pages x 2 layers, + the hidden-state row
    c = Cluster(tiny_model_dir, prefill_faults=[("delay", 0, leaver_writes, 700_000)],
                decode_over={"kv_cache__num_pages": 10})
    eng, conn = c.decode_engine, c.decode_engine.connector
    quarantined, admitted = {}, []
    finished, admit = conn.finished, conn.admit

    def on_finished(req):  # engine thread, right after abort(quarantine=...) detached the pages
        held = eng._held.get(req.request_id)  # noqa: SLF001 (the engine's quarantine, observed)
        if held is not None:
            quarantined[req.request_id] = set(held[0])
        finished(req)

    def on_admit(req):  # engine thread: what the request got, and what was held at that moment
        ok = admit(req)
        if ok and req.num_external_tokens:
            held = {p for pages, _ in eng._held.values() for p in pages}  # noqa: SLF001
            admitted.append((req.request_id, set(req.pages), held,
                             {rid for rid in quarantined if rid in c.coordinator.by_rid},
                             c.decode.app[NODE].messenger.stats()["imms"]))
        return ok
    conn.finished, conn.admit = on_finished, on_admit
    try:
        name = c.model_name()
        # leave once the prefill node posted every write (they land 0.7 s later): leaving at a
        # fixed time could come before the job ran, and a job cancelled before it posted
        # anything rightly frees the pages at once
        posted = lambda: c.prefill.app[NODE].messenger.stats()["writes_posted"] >= leaver_writes  # noqa: E731
        _send_and_leave(c.url, {"model": name, "prompt": list(range(40, 70)), "max_tokens": 4}, posted)
        # the client is gone, but its pages stay quarantined while the delayed writes can land
        wait_for(lambda: quarantined, 5, "quarantined pages")
        imms = c.decode.app[NODE].messenger.stats()["imms"]
        assert imms < leaver_writes, imms  # sent before the leaver's writes landed
        prompt = list(range(5, 30))
        result = _post(c.url, _greedy(name, prompt))
        assert _tokens(result) == _want(tiny_model_dir, tuple(prompt), 4)
        (leaver, held_pages), = quarantined.items()
        assert len(held_pages) == 8
        (rid, pages, held_then, draining_then, imms_then), = [a for a in admitted if a[0] != leaver]
        assert pages & held_pages, (pages, held_pages)  # it needed the freed pages ...
        # ... and got them only once every write of the leaver had landed
        assert imms_then >= leaver_writes and not pages & held_then and not draining_then, \
            (imms_then, held_then, draining_then)
        wait_for(c.pools_full, 10, "both page pools back to full")
        assert eng.num_held_pages == 0 and not c.coordinator.slots
    finally:
        c.stop()


def test_transfer_timeout_fails_that_client_clearly(tiny_model_dir):
    from pdkv.engine.loop import FailRequest

    c = Cluster(tiny_model_dir, prefill_faults=[DELAY], decode_over={"messenger__transfer_timeout_s": 0.3})
    failed_at, put = [], c.coordinator.commands

    def commands(cmd):  # event loop: the decode side fails the request; what had landed then?
        if isinstance(cmd, FailRequest):
            slot = c.coordinator.by_rid.get(cmd.request_id)
            failed_at.append((c.decode.app[NODE].messenger.stats()["imms"], slot and slot.expected,
                              slot and slot.state.value))
        put(cmd)
    c.coordinator.commands = commands
    try:
        status, body = _post(c.url, {"model": c.model_name(), "prompt": list(range(5, 30)), "max_tokens": 4})
        assert status == 500 and "timed out after 0.3 s" in body["error"]["message"], body
        assert "transfer_timeout_s" in body["error"]["message"]
        # the error came from the timeout, before the delayed writes: fewer immediates than expected
        (imms, expected, state), = failed_at
        assert state == "sent" and imms < expected, failed_at
        wait_for(c.pools_full, 10, "both page pools back to full")
        assert c.decode.app[NODE].messenger.stats()["imms"] == expected  # they did land, later
        metrics = urllib.request.urlopen(c.url + "/metrics").read().decode()
        failures = [x for x in metrics.splitlines() if x.startswith("pdkv_kv_transfer_failures_total")]
        assert [x for x in failures if not x.endswith(" 0.0")] == [
            x for x in failures if 'reason="timeout"' in x] and any(x.endswith(" 1.0") for x in failures), failures
    finally:
        c.stop()


def test_prefill_fail_reaches_the_client_and_others_finish(tiny_model_dir):
    # the prefill pool (4 pages x 4 tokens) cannot hold a 40-token prompt: it answers FAIL
    c = Cluster(tiny_model_dir, prefill_over={"kv_cache__num_pages": 4})
    try:
        name = c.model_name()
        big, bbox = _in_thread(_post, c.url, {"model": name, "prompt": list(range(5, 45)), "max_tokens": 4})
        other = _post(c.url, _greedy(name, list(range(5, 12))))
        big.join(30)
        assert _tokens(other) == _want(tiny_model_dir, tuple(range(5, 12)), 4)
        bstatus, bbody = bbox["r"]
        assert bstatus == 500, bbody
        msg = bbody["error"]["message"]
        assert "prefill node failed the request" in msg and "10 KV pages" in msg and "only 4" in msg, msg
        wait_for(c.pools_full, 10, "both page pools back to full")
    finally:
        c.stop()


def test_client_leaves_mid_decode(tiny_model_dir):
    c = Cluster(tiny_model_dir)
    try:
        name = c.model_name()
        host, port = c.url.removeprefix("http://").split(":")
        raw = json.dumps({"model": name, "prompt": list(range(5, 20)), "max_tokens": 200, "stream": True,
                          "ignore_eos": True}).encode()
        s = socket.create_connection((host, int(port)))
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  + f"Content-Length: {len(raw)}\r\n\r\n".encode() + raw)
        got = b""
        s.settimeout(20)
        while got.count(b"data:") < 3:  # tokens are streaming: the KV arrived, decode runs
            got += s.recv(65536)
            assert got.startswith(b"HTTP/1.1 200"), got[:300]
        s.close()
        wait_for(c.pools_full, 10, "both page pools back to full")
        got = _tokens(_post(c.url, _greedy(name, list(range(5, 20)), 3)))
        assert got == _want(tiny_model_dir, tuple(range(5, 20)), 3)
    finally:
        c.stop()


def test_error_completion_of_a_write_that_landed_does_not_fail_the_request(tiny_model_dir):
    """FAKE ERROR: a write lands but completes locally with -EIO. The decode node's immediate
    count is the truth: the request is served; the prefill node's later FAIL finds no slot."""
    c = Cluster(tiny_model_dir, prefill_faults=[("error", 0, 1, 0)])
    try:
        got = _tokens(_post(c.url, _greedy(c.model_name(), list(range(5, 30)))))
        assert got == _want(tiny_model_dir, tuple(range(5, 30)), 4)
        wait_for(c.pools_full, 10, "both page pools back to full")
    finally:
        c.stop()


def test_data_connection_lost_mid_transfer_fails_clearly_and_drains_what_landed(tiny_model_dir):
    """FAKE VANISH at the 4th write: the rest fail; the prefill node answers FAIL with the number
    of writes that did land, the decode node fails the client and frees the pages once exactly
    those landed."""
    c = Cluster(tiny_model_dir, prefill_faults=[("vanish", 3, 1, 0)])
    try:
        status, body = _post(c.url, {"model": c.model_name(), "prompt": list(range(5, 30)), "max_tokens": 4})
        assert status == 500, body
        msg = body["error"]["message"]
        assert "prefill node failed the request" in msg and "write(s) failed" in msg, msg
        wait_for(c.pools_full, 10, "both page pools back to full")
        assert not c.coordinator.slots
    finally:
        c.stop()


class SlowGrants:
    """FAULT INJECTION: the decode node's messenger as its grants see it, with every grant_range
    taking ``delay_s`` (what registering a large MR costs on verbs); records the threads it ran on."""

    def __init__(self, m, delay_s: float):
        self.m, self.delay_s, self.threads = m, delay_s, set()

    def grant_range(self, *args):
        import time

        self.threads.add(threading.current_thread().name)
        time.sleep(self.delay_s)
        return self.m.grant_range(*args)

    def __getattr__(self, name):
        return getattr(self.m, name)


def test_grants_are_made_off_the_event_loop_and_a_client_leaving_meanwhile_gets_them_revoked(tiny_model_dir):
    """Slow grant registrations run in the grant thread: /health and the decode node's loop answer
    meanwhile. A client that leaves while its grants are made is never sent; its grants are
    revoked and its pages return; the next request is served as colocated."""
    import time

    c = Cluster(tiny_model_dir, prefill_faults=[("delay", 0, 0, 1000)])
    try:
        grants = c.coordinator.memory.grants
        slow = grants.m = SlowGrants(grants.m, 0.3)  # a range per layer and run, and the hidden row
        # the stand-in registers slowly, as verbs does: the grant thread's case (tcp's grants are
        # table entries, made on the event loop: the test below)
        c.coordinator.instant_grants = False
        name = c.model_name()
        prompt = list(range(7, 30))
        t, box = _in_thread(_post, c.url, _greedy(name, prompt))
        wait_for(lambda: c.coordinator._granting, 10, "the grant thread at work")
        t0 = time.monotonic()
        with urllib.request.urlopen(c.url + "/health", timeout=10) as r:
            assert r.status == 200
        assert time.monotonic() - t0 < 0.5 and c.coordinator._granting  # answered mid-grant
        t.join(30)
        assert _tokens(box["r"]) == _want(tiny_model_dir, tuple(prompt), 4)
        assert slow.threads == {"pdkv-decode-grant_0"}, slow.threads
        link = c.prefill.app[NODE].coordinator.links[0]
        sent = link.num_prefills
        _send_and_leave(c.url, _greedy(name, list(range(40, 60))), lambda: c.coordinator._granting)
        wait_for(lambda: not c.coordinator._granting, 10, "the grants made")
        wait_for(c.pools_full, 10, "both page pools back to full")
        assert not c.coordinator.slots and not c.coordinator.held  # revoked, nothing in flight
        time.sleep(0.3)
        assert link.num_prefills == sent  # the PREFILL never left
    finally:
        c.stop()


def test_tcp_grants_are_made_on_the_event_loop_without_the_grant_thread(tiny_model_dir):
    """tcp's grants are entries in the receiver's table (Capability.INSTANT_GRANTS): made where
    PREFILL is sent, with no crossing to the grant thread and back."""
    c = Cluster(tiny_model_dir)
    try:
        assert c.coordinator.instant_grants
        grants = c.coordinator.memory.grants
        seen = grants.m = SlowGrants(grants.m, 0.0)
        prompt = list(range(7, 30))
        assert _tokens(_post(c.url, _greedy(c.model_name(), prompt))) == _want(tiny_model_dir, tuple(prompt), 4)
        assert seen.threads and "pdkv-decode-grant_0" not in seen.threads, seen.threads
        wait_for(c.pools_full, 10, "both page pools back to full")
    finally:
        c.stop()
