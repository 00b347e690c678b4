"""The staging pipeline on both roles (messenger.staging: cpu): every page goes device-to-host
through the prefill node's ring and host-to-device out of the decode node's landing slots, on
the CPU copy engine, over tcp. The same prompts as the equality tests arrive byte-exact (same
greedy tokens, same KV pages), also with random copy delays and a ring too small for the load
(backpressure); a failed copy fails that request clearly and a cancelled one frees everything;
every pool, ring and copy queue is back to its start afterwards.

The copy engines' ``_inject`` hook is FAULT INJECTION (pdkv/gpu/cpu_copy_engine.py): called
before each span, it sleeps, blocks or raises.
"""
from __future__ import annotations

import json
import random
import socket
import threading
import time
import urllib.request

import pytest
import torch

from pdkv.server.app import NODE

from _cluster import Cluster, colocated_kv, hold_kv_on_landing, keep_landed_hidden, post_completion, read_kv, wait_for
from test_equality import PROMPTS, _colocated, _complete

STAGED = {"messenger__staging": "cpu"}
L = 2  # the tiny model's layers; a page of one layer is 1 KiB (2 KV heads x 4 tokens x 16 x fp32 x K,V)


def _staged_cluster(model_dir, prefill=None, decode=None):
    c = Cluster(model_dir, prefill_over={**STAGED, **(prefill or {})}, decode_over={**STAGED, **(decode or {})})
    pc = c.prefill.app[NODE].coordinator
    return c, pc, pc.staged.copy, c.coordinator.landing.copy


def _all_requests(c):
    name = c.model_name()
    results = [None] * len(PROMPTS)
    threads = [threading.Thread(target=_complete, args=(c.url, name, p, results, i)) for i, p in enumerate(PROMPTS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert all(r is not None for r in results)
    return results


def _assert_idle(c, pc, pcopy, dcopy):
    """Nothing leaked: both pools full, both rings free, no copy job, no staged write slot."""
    wait_for(c.pools_full, 10, "both page pools back to full")
    wait_for(lambda: pcopy.num_jobs() == 0 and dcopy.num_jobs() == 0, 5, "copy engines idle")
    assert pcopy.ring.owners() == {} and dcopy.ring.owners() == {}
    assert pcopy.ring.num_free == pcopy.ring.num_slots and dcopy.ring.num_free == dcopy.ring.num_slots
    assert pc.staged.num_slots_in_use() == 0 and c.coordinator.landing.num_reserved() == 0
    assert not c.coordinator.slots and not pc.jobs.jobs
    for url in (c.prefill.url, c.url):  # the gauges say the same
        text = urllib.request.urlopen(url + "/metrics").read().decode()
        values = [float(x.split()[-1]) for x in text.splitlines() if x.startswith("pdkv_kv_staging_")]
        assert values and all(v == 0 for v in values), values


@pytest.mark.parametrize("chunk,layerwise,delays", [(4, True, False), (64, False, False), (4, True, True)])
def test_staged_tokens_and_kv_equal_colocated(tiny_model_dir, chunk, layerwise, delays):
    want_tokens, want_hidden = _colocated(tiny_model_dir)
    want_kv = colocated_kv(tiny_model_dir, PROMPTS)
    # NOTE: the decode node's prefix cache off, as in the equality test: these prompts share
    # prefixes and arrive together, so with it on, how many pages move depends on which lands
    # first, and the exact write count below would not hold
    c, pc, pcopy, dcopy = _staged_cluster(tiny_model_dir, {"scheduler__chunk_size": chunk,
                                                           "messenger__layerwise": layerwise},
                                          {"kv_cache__prefix_caching": False})
    if delays:  # FAULT INJECTION: every span of every copy, on both sides, 0-3 ms late
        rng = random.Random(13)
        pcopy._inject = dcopy._inject = lambda result, i: time.sleep(rng.uniform(0, 0.003))
    landed_kv = hold_kv_on_landing(c.coordinator, c.decode_engine)
    hidden = keep_landed_hidden(c.coordinator)
    sent_kv, after_forward = {}, pc.connector.after_forward

    def on_forward(batch, hidden):  # prefill engine thread: each prompt's KV where it was computed
        for e in batch.entries:
            if hidden is not None and e.is_last_chunk:
                r = e.request
                sent_kv[tuple(r.prompt_token_ids)] = read_kv(c.prefill_engine.kv, r.pages, r.num_prompt_tokens)
        after_forward(batch, hidden)
    pc.connector.after_forward = on_forward
    try:
        results = _all_requests(c)
        assert [(r["choices"][0]["token_ids"], r["choices"][0]["text"]) for r in results] == want_tokens
        for r, p in zip(results, PROMPTS):
            torch.testing.assert_close(hidden[r["id"] + "-0"], want_hidden[tuple(p)],
                                       rtol=1e-4, atol=1e-5)
            # RemoteKVReady comes after the copy-in: these are the KV pages, not the landing slots
            _, (got,) = landed_kv[r["id"] + "-0"]
            want = [w[:, :len(p) - 1] for w in want_kv[tuple(p)]]
            for layer, (g, w, sent) in enumerate(zip(got, want, sent_kv[tuple(p[:-1])])):
                # byte-exact: what the prefill node computed is what the decode node's pages hold
                assert torch.equal(g, sent), f"{len(p)}-token prompt, layer {layer}: staged KV differs from the sent"
                torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)  # and that is the colocated KV
        pages = sum(-(-(len(p) - 1) // 4) for p in PROMPTS)
        # the decode node may answer before the prefill node's poller counted its last completions
        wait_for(lambda: pc.m.stats()["writes_done"] >= pages * L + len(PROMPTS), 10, "every write counted")
        st = pc.m.stats()
        assert st["writes_posted"] == st["writes_done"] == pages * L + len(PROMPTS)
        # every page went through a staging slot: the KV memory itself was never registered
        assert pc.kv.keys == [] and c.coordinator.landing.kv.keys == []
        _assert_idle(c, pc, pcopy, dcopy)
    finally:
        c.stop()


def test_full_rings_apply_backpressure_and_everything_completes(tiny_model_dir):
    """Prefill: 2 slots of one page (1 KiB) for copies of ~20 pages per layer, each span 2 ms
    late: copies wait in the engine's FIFO (seen), none is refused. Decode: 12 landing slots for
    prompts of up to 10 pages: requests wait for slots at admission. Same answers."""
    want_tokens, _ = _colocated(tiny_model_dir)
    c, pc, pcopy, dcopy = _staged_cluster(
        tiny_model_dir, {"messenger__staging_mib": 2 / 1024, "messenger__staging_slot_kib": 1,
                         "messenger__staging_max_pending": 1000},
        {"messenger__staging_mib": 24 / 1024})
    assert pcopy.ring.num_slots == 2 and c.coordinator.landing.num_slots == 12
    most = {"pending": 0, "landing": 0}

    def slow(result, i):  # FAULT INJECTION: slow copies, and what was waiting meanwhile
        most["pending"] = max(most["pending"], pcopy.num_pending)
        most["landing"] = max(most["landing"], c.coordinator.landing.num_reserved())
        time.sleep(0.002)
    pcopy._inject = slow
    landing, waited = c.coordinator.landing, []
    reserve = landing.reserve

    def counting_reserve(rid, n):  # engine thread: a False is a request kept waiting for landing slots
        ok = reserve(rid, n)
        waited.extend([] if ok else [rid])
        return ok
    landing.reserve = counting_reserve
    try:
        results = _all_requests(c)
        assert [(r["choices"][0]["token_ids"], r["choices"][0]["text"]) for r in results] == want_tokens
        assert most["pending"] > 0, most  # the prefill ring was full: copies waited for a slot
        assert waited and most["landing"] <= 12, (waited, most)  # decode: requests waited for landing slots
        _assert_idle(c, pc, pcopy, dcopy)
    finally:
        c.stop()


@pytest.mark.parametrize("side", ["prefill", "decode"])
def test_a_failed_copy_fails_that_request_clearly_and_leaks_nothing(tiny_model_dir, side):
    """Prefill: the copies of layer 1 fail (layer 0's writes left: the decode node drains exactly
    those before the pages go back). Decode: a copy-in fails after its first span (a page half
    written: quarantined, then released). The next request is served exactly."""
    c, pc, pcopy, dcopy = _staged_cluster(tiny_model_dir)
    armed = threading.Event()
    armed.set()

    def fail(result, i):  # FAULT INJECTION: while armed, the copies raise (on one side)
        if armed.is_set() and (result.tag.layer == 1 if side == "prefill" else i == 1):
            raise OSError("injected DMA error")
    (pcopy if side == "prefill" else dcopy)._inject = fail
    try:
        name = c.model_name()
        status, body = post_completion(c.url, {"model": name, "prompt": list(range(40, 70)), "max_tokens": 4})
        assert status == 500, body
        msg = body["error"]["message"]
        if side == "prefill":
            assert "prefill node failed the request" in msg and "device-to-host staging copy" in msg, msg
        else:
            assert "copying the KV from staging into its pages failed" in msg and "host-to-device" in msg, msg
        assert "injected DMA error" in msg, msg
        _assert_idle(c, pc, pcopy, dcopy)
        armed.clear()
        want_tokens, _ = _colocated(tiny_model_dir)
        results = _all_requests(c)
        assert [(r["choices"][0]["token_ids"], r["choices"][0]["text"]) for r in results] == want_tokens
        _assert_idle(c, pc, pcopy, dcopy)
    finally:
        c.stop()


def _leave_when(url, body, event: threading.Event) -> None:
    """A client that sends a request and closes its socket once ``event`` is set."""
    host, port = url.removeprefix("http://").split(":")
    raw = json.dumps(body).encode()
    s = socket.create_connection((host, int(port)))
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              + f"Content-Length: {len(raw)}\r\n\r\n".encode() + raw)
    event.wait(10)
    s.close()


@pytest.mark.parametrize("side", ["prefill", "decode"])
def test_a_client_that_leaves_mid_copy_frees_everything(tiny_model_dir, side):
    """The victim's first copy is held mid-way (FAULT INJECTION: its first span blocks) when its
    client leaves: the decode node cancels (prefill: CANCEL, the job's copies are cancelled;
    decode: the copy-in is cancelled) and releases the pages only once the copy ended."""
    c, pc, pcopy, dcopy = _staged_cluster(tiny_model_dir)
    held, go = threading.Event(), threading.Event()

    def block(result, i):
        if i == 0 and not held.is_set():
            held.set()
            go.wait(10)  # hang guard only
    (pcopy if side == "prefill" else dcopy)._inject = block
    try:
        name = c.model_name()
        leaver = threading.Thread(target=_leave_when, args=(c.url, {"model": name, "prompt": list(range(40, 70)),
                                                                    "max_tokens": 4}, held))
        leaver.start()
        assert held.wait(10)
        leaver.join(5)
        if side == "prefill":  # the decode node sent CANCEL: the job ended in the engine, copies pending
            wait_for(lambda: c.coordinator.slots and all(s.state.value == "cancelling"
                                                         for s in c.coordinator.slots.values()),
                     10, "the decode node cancelling the transfer")
            wait_for(lambda: any(j.end is not None for j in pc.jobs.values()), 10, "the prefill job ended")
        else:
            wait_for(lambda: not c.decode_engine.requests, 10, "the request aborted on the decode node")
            time.sleep(0.2)  # a release that came too early would have been applied by now
        assert c.decode_engine.num_held_pages > 0  # quarantined while a write or a copy may touch them
        go.set()
        _assert_idle(c, pc, pcopy, dcopy)
        status, body = post_completion(c.url, {"model": name, "prompt": PROMPTS[3], "max_tokens": 2})
        assert status == 200, body
    finally:
        go.set()
        c.stop()


def test_a_prompt_larger_than_the_landing_ring_is_refused_clearly(tiny_model_dir):
    """4 landing slots (one 4-token page of both layers each): a 21-token prompt can never fit,
    so it is refused at once (400, naming the setting) instead of waiting forever; a short one is served."""
    c, pc, pcopy, dcopy = _staged_cluster(tiny_model_dir, decode={"messenger__staging_mib": 8 / 1024})
    try:
        name = c.model_name()
        status, body = post_completion(c.url, {"model": name, "prompt": PROMPTS[3], "max_tokens": 2})
        assert status == 400, body
        msg = body["error"]["message"]
        assert "needs 6 staging slots" in msg and "ring has 4" in msg and "messenger.staging_mib" in msg, msg
        status, body = post_completion(c.url, {"model": name, "prompt": PROMPTS[1], "max_tokens": 2})
        assert status == 200, body
        _assert_idle(c, pc, pcopy, dcopy)
    finally:
        c.stop()


def test_a_client_that_leaves_after_landing_before_the_copy_in_frees_everything(tiny_model_dir):
    """Every write landed, but a grant is still being revoked (FAULT INJECTION: revoke reports the
    ranges busy until released) when the client leaves: the copy-in must then never start, and
    the pages stay quarantined until the revoke is done."""
    c, pc, pcopy, dcopy = _staged_cluster(tiny_model_dir)
    grants, held, go, copies = c.coordinator.grants, threading.Event(), threading.Event(), []
    revoke = grants.revoke

    def busy_revoke(peer, ranges):  # event loop: the grants of a landed request cannot go yet
        if not go.is_set():
            held.set()
            return list(ranges)
        return revoke(peer, ranges)
    grants.revoke = busy_revoke
    dcopy._inject = lambda result, i: copies.append(result.request_id)
    try:
        name = c.model_name()
        leaver = threading.Thread(target=_leave_when, args=(c.url, {"model": name, "prompt": list(range(40, 70)),
                                                                    "max_tokens": 4}, held))
        leaver.start()
        assert held.wait(10)
        leaver.join(5)
        wait_for(lambda: c.coordinator._aborted, 10, "the client's abort seen by the coordinator")  # noqa: SLF001
        assert c.decode_engine.num_held_pages > 0  # quarantined: the revoke (then the copy-in) is pending
        go.set()
        _assert_idle(c, pc, pcopy, dcopy)
        assert copies == []  # nobody was left to copy the KV for
        assert not c.coordinator._aborted  # noqa: SLF001
    finally:
        go.set()
        c.stop()
