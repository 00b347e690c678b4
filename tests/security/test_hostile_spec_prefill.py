"""Malformed speculative hand-off fields of PREFILL against a real mtp prefill node (tcp,
loopback): proposer pages (``spec_pages``) that are not one per page, distinct and inside the
peer's proposer cache, a held-back token (``next_token``) that is not a token id, and proposer
ranges' write keys (``spec_runs``/``spec_rkeys``, one per MTP layer and run of proposer pages,
pdkv/disagg/range_keys.py) that do not cover the proposer pages, or are not keys, get FAIL
naming the field and nothing posted; a well-formed PREFILL of the same hostile peer is served;
the real decode node keeps serving and no page is leaked."""

import asyncio

import pytest
from _cluster import Cluster, post_completion, wait_for
from _hostile import HostileDecode

from pdkv.disagg import protocol as P
from pdkv.server.app import NODE

MTP = {"speculative__method": "mtp", "speculative__num_tokens": 2}
PROMPT = {"prompt": [5, 9, 33, 71, 2, 8, 40], "max_tokens": 6, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    from pdkv.tiny_model import make_tiny_model

    c = Cluster(make_tiny_model(tmp_path_factory.mktemp("mtp"), seed=0, num_nextn_predict_layers=1),
                prefill_over=MTP, decode_over=MTP)
    c.pc = c.prefill.app[NODE].coordinator
    c.expected = post_completion(c.url, {**PROMPT, "model": c.model_name()})[1]["choices"][0]["text"]
    yield c
    c.stop()


def _still_serves(c):
    status, body = post_completion(c.url, {**PROMPT, "model": c.model_name()})
    assert status == 200 and body["choices"][0]["text"] == c.expected, body
    wait_for(c.pools_full, 10, "every page back in both pools")
    assert len(c.pc.jobs) == 0


def _prefill(h, req, **over):
    return {"type": P.PREFILL, "req": req, "tokens": [1, 2, 3], "pages": [0], "imm": 1, "hidden_off": 0,
            "expected": 10**6, "spec_pages": [0], "next_token": 4, "spec_runs": [[0, 1]],
            "spec_rkeys": [h.spec_key], **over}


@pytest.mark.parametrize("bad,words", [
    ({"spec_rkeys": [1, 2]}, "spec_rkeys must be 1 keys"),  # one MTP layer x one run
    ({"spec_rkeys": [-1]}, "spec_rkeys must be"),
    ({"spec_rkeys": "1"}, "spec_rkeys must be"),
    ({"spec_runs": [[1, 1]]}, "spec_runs: page 0 is in no granted run"),
    ({"spec_runs": "0,1"}, "spec_runs must be a non-empty list"),
    ({"spec_runs": [[0, 1], [0, 1]], "spec_rkeys": [1, 1]}, "spec_runs: 2 runs for 1 pages"),
    ({"spec_runs": None}, "spec_runs must be"),
])
def test_malformed_proposer_keys_are_answered_with_fail(cluster, bad, words, caplog):
    async def main():
        h = HostileDecode(cluster.pc)
        try:
            ch = await h.connect(cluster.prefill.app[NODE].control_port, None)
            await ch.send(_prefill(h, "m", **bad))
            got = await h.until(lambda m: m["type"] == P.FAIL)
            assert words in got[-1]["reason"] and got[-1]["posted"] == 0, got[-1]
        finally:
            h.close()
    asyncio.run(main())
    assert "Traceback" not in caplog.text
    _still_serves(cluster)


TOP = "top"  # stands for the peer's proposer page count (HELLO extra.spec_kv.num_pages)


@pytest.mark.parametrize("bad,words", [
    ({"spec_pages": [0, 1]}, "spec_pages must be 1 page numbers"),  # one per target page
    ({"spec_pages": []}, "spec_pages must be 1 page numbers"),
    ({"tokens": [1, 2, 3, 4, 5], "pages": [0, 1], "spec_pages": [2]}, "spec_pages must be 2 page numbers"),
    ({"tokens": [1, 2, 3, 4, 5], "pages": [0, 1], "spec_pages": [2, 2]}, "spec_pages must be distinct"),
    ({"spec_pages": [TOP]}, "spec_pages must be 1 page numbers in [0, top)"),  # the first page past the end
    ({"spec_pages": [-1]}, "spec_pages must be 1 page numbers"),
    ({"spec_pages": [True]}, "spec_pages must be 1 page numbers"),
    ({"spec_pages": "0"}, "spec_pages must be 1 page numbers"),
    ({"spec_pages": None}, "spec_pages must be 1 page numbers"),
    ({"next_token": -1}, "next_token must be a token id"),
    ({"next_token": 2**31}, "next_token must be a token id"),
    ({"next_token": "4"}, "next_token must be a token id"),
    ({"next_token": True}, "next_token must be a token id"),
    ({"next_token": None}, "next_token must be a token id"),
], ids=["too-many", "none", "too-few", "duplicate", "past-the-end", "negative", "bool", "str", "null",
        "next-negative", "next-too-big", "next-str", "next-bool", "next-null"])
def test_malformed_spec_pages_and_next_token_are_answered_with_fail(cluster, bad, words, caplog):
    """The hand-off's own fields (pdkv/disagg/spec_handoff.py parse_fields): the proposer pages
    a PREFILL names must be one per target page, distinct, inside the peer's proposer cache;
    next_token (mtp) a token id. Each is refused with FAIL naming it, nothing posted."""
    top = cluster.pc.hello.extra["spec_kv"]["num_pages"]
    bad = {k: [top if p == TOP else p for p in v] if isinstance(v, list) else v for k, v in bad.items()}
    words = words.replace(TOP, str(top))

    async def main():
        h = HostileDecode(cluster.pc)
        try:
            ch = await h.connect(cluster.prefill.app[NODE].control_port, None)
            await ch.send(_prefill(h, "s", **bad))
            got = await h.until(lambda m: m["type"] in (P.FAIL, P.DONE_AT))
            assert got[-1]["type"] == P.FAIL and words in got[-1]["reason"] and got[-1]["posted"] == 0, got[-1]
        finally:
            h.close()
    asyncio.run(main())
    assert "Traceback" not in caplog.text
    assert len(cluster.pc.jobs) == 0


def test_well_formed_proposer_keys_are_served(cluster):
    """The same PREFILL with keys that cover its proposer page: the job runs (DONE_AT, no FAIL)
    and its MTP KV lands in the peer's proposer buffer."""
    async def main():
        h = HostileDecode(cluster.pc)
        try:
            ch = await h.connect(cluster.prefill.app[NODE].control_port, None)
            await ch.send(_prefill(h, "ok", hidden_rkey=h.hidden_key, runs=[[0, 1]], kv_rkeys=[h.kv_key] * 2))
            got = await h.until(lambda m: m["type"] in (P.DONE_AT, P.FAIL))
            assert got[-1]["type"] == P.DONE_AT, got[-1]
            wait_for(lambda: any(h.spec_buf), 10, "the MTP KV in the proposer buffer")
        finally:
            h.close()
    asyncio.run(main())
    _still_serves(cluster)
