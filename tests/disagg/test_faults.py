"""Lifecycle on the FAKE in-process transport (fault injection: delayed writes): a client that
leaves mid-transfer or mid-decode, a transfer timeout, a prefill FAIL. Each ends with a clear
error (or abort) for that client only, other requests finish, and both page pools return to
their start -- after the quarantine: never while a write can still land."""
from __future__ import annotations

import json
import socket
import threading
import time
import urllib.error
import urllib.request

from _cluster import Cluster, post_completion as _post, wait_for

DELAY = ("delay", 0, 0, 700_000)  # every prefill write lands 0.7 s late


def _in_thread(fn, *args):
    box = {}
    t = threading.Thread(target=lambda: box.setdefault("r", fn(*args)))
    t.start()
    return t, box


def _send_and_leave(url, body, after):
    """A client that sends a request and closes its socket ``after`` seconds later."""
    host, port = url.removeprefix("http://").split(":")
    raw = json.dumps(body).encode()
    s = socket.create_connection((host, int(port)))
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              + f"Content-Length: {len(raw)}\r\n\r\n".encode() + raw)
    time.sleep(after)
    s.close()


def test_client_leaves_mid_transfer_pages_wait_for_the_writes(tiny_model_dir):
    c = Cluster(tiny_model_dir, prefill_faults=[DELAY])
    try:
        name = c.model_name()
        other, box = _in_thread(_post, c.url, {"model": name, "prompt": list(range(5, 30)), "max_tokens": 4,
                                               "ignore_eos": True})
        _send_and_leave(c.url, {"model": name, "prompt": list(range(40, 70)), "max_tokens": 4}, 0.2)
        # the client is gone, but its pages stay quarantined while the delayed writes can land
        wait_for(lambda: c.decode_engine.num_held_pages > 0, 5, "quarantined pages")
        other.join(30)
        status, body = box["r"]
        assert status == 200 and body["usage"]["completion_tokens"] == 4, body
        wait_for(c.pools_full, 10, "both page pools back to full")
        assert c.decode_engine.num_held_pages == 0 and not c.coordinator.slots
    finally:
        c.stop()


def test_transfer_timeout_fails_that_client_clearly(tiny_model_dir):
    c = Cluster(tiny_model_dir, prefill_faults=[DELAY], decode_over={"messenger__transfer_timeout_s": 0.3})
    try:
        t0 = time.monotonic()
        status, body = _post(c.url, {"model": c.model_name(), "prompt": list(range(5, 30)), "max_tokens": 4})
        assert time.monotonic() - t0 < 0.7 + 0.5  # the error came from the timeout, not the writes
        assert status == 500 and "timed out after 0.3 s" in body["error"]["message"], body
        assert "transfer_timeout_s" in body["error"]["message"]
        wait_for(c.pools_full, 10, "both page pools back to full")
        metrics = urllib.request.urlopen(c.url + "/metrics").read().decode()
        line = [x for x in metrics.splitlines() if x.startswith("pdkv_kv_transfer_failures_total")
                and 'reason="timeout"' in x]
        assert line and line[0].endswith(" 1.0"), [x for x in metrics.splitlines() if "failures" in x]
    finally:
        c.stop()


def test_prefill_fail_reaches_the_client_and_others_finish(tiny_model_dir):
    # the prefill pool (4 pages x 4 tokens) cannot hold a 40-token prompt: it answers FAIL
    c = Cluster(tiny_model_dir, prefill_over={"kv_cache__num_pages": 4})
    try:
        name = c.model_name()
        big, bbox = _in_thread(_post, c.url, {"model": name, "prompt": list(range(5, 45)), "max_tokens": 4})
        status, body = _post(c.url, {"model": name, "prompt": list(range(5, 12)), "max_tokens": 4,
                                     "ignore_eos": True})
        big.join(30)
        assert status == 200 and body["usage"]["completion_tokens"] == 4
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
        status, body = _post(c.url, {"model": name, "prompt": list(range(5, 20)), "max_tokens": 3})
        assert status == 200
    finally:
        c.stop()


def test_error_completion_of_a_write_that_landed_does_not_fail_the_request(tiny_model_dir):
    """FAKE ERROR: a write lands but completes locally with -EIO. The decode node's immediate
    count is the truth: the request is served; the prefill node's later FAIL finds no slot."""
    c = Cluster(tiny_model_dir, prefill_faults=[("error", 0, 1, 0)])
    try:
        status, body = _post(c.url, {"model": c.model_name(), "prompt": list(range(5, 30)), "max_tokens": 4,
                                     "ignore_eos": True})
        assert status == 200 and body["usage"]["completion_tokens"] == 4, body
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
