"""The bounds on what the decode node grants (registers, on verbs) for prefill peers: a request
needing more ranges than messenger.max_grants_per_request, or one that no peer has room for
under messenger.max_grants_per_peer, is refused with 503 naming the limit before anything is
granted or sent; its pages come back and the node keeps serving (tcp, in-process)."""

import dataclasses

import pytest
from _cluster import Cluster, post_completion, wait_for

PROMPT = {"prompt": "Tutte le strade portano a Roma", "max_tokens": 4, "temperature": 0}


@pytest.fixture(scope="module")
def cluster(tiny_model_dir):
    c = Cluster(tiny_model_dir)
    c.expected = post_completion(c.url, {**PROMPT, "model": c.model_name()})[1]["choices"][0]["text"]
    yield c
    c.stop()


@pytest.mark.parametrize("limit", ["max_grants_per_request", "max_grants_per_peer"])
def test_a_request_beyond_a_grant_limit_gets_503_naming_it(cluster, limit):
    d = cluster.coordinator
    real = d.mcfg
    d.mcfg = dataclasses.replace(real, **{limit: 2})  # a request of the 2-layer model needs 1 + 2
    try:
        status, body = post_completion(cluster.url, {**PROMPT, "model": cluster.model_name()})
    finally:
        d.mcfg = real
    assert status == 503 and f"messenger.{limit}" in body["error"]["message"], body
    wait_for(cluster.pools_full, 10, "every page back")
    assert not d.held and not d.slots  # nothing was granted, nothing sent
    status, body = post_completion(cluster.url, {**PROMPT, "model": cluster.model_name()})
    assert status == 200 and body["choices"][0]["text"] == cluster.expected
