"""messenger.transport auto (pdkv/csrc/auto.c): nodes whose HELLOs name one host move KV through
shm, counted per route in nic_stats and /metrics; a peer whose shm connection info claims
another boot id (fault injection: the HELLO says one host, the host check says otherwise) falls
back to tcp, logged, and still answers the colocated tokens. A grant the prefill process fails
to map (fault injection) fails that request on shm with an error naming it, every page coming
back; on auto that link's grants go through tcp from then on, and the request is served."""
from __future__ import annotations

import logging

import pytest

from _cluster import Cluster, colocated_tokens, post_completion, wait_for
from pdkv.disagg.protocol import host_identity
from pdkv.server.app import NODE

PROMPTS = [list(range(3, 3 + n)) for n in (2, 9, 21)]
MAX_TOKENS = 5
AUTO = {"messenger__transport": "auto"}


def _complete(c, prompt):
    return post_completion(c.url, {"model": c.model_name(), "prompt": prompt, "max_tokens": MAX_TOKENS,
                                   "temperature": 0, "ignore_eos": True, "return_token_ids": True}, 60)


def _routes(c) -> dict:
    """{node: {route: its nic_stats}} of both nodes' auto messengers."""
    return {name: {s["name"]: s for s in t.app[NODE].messenger.nic_stats()}
            for name, t in (("prefill", c.prefill), ("decode", c.decode))}


def _metric(url: str, line_start: str) -> float:
    import urllib.request

    text = urllib.request.urlopen(url + "/metrics", timeout=10).read().decode()
    return sum(float(x.split()[-1]) for x in text.splitlines() if x.startswith(line_start))


@pytest.fixture(scope="module")
def want(tiny_model_dir):
    return [colocated_tokens(tiny_model_dir, p, MAX_TOKENS) for p in PROMPTS]


def test_host_identity_is_stable_and_says_nothing_readable():
    h = host_identity()
    assert h == host_identity() and len(h) == 32
    assert open("/proc/sys/kernel/random/boot_id").read().strip() not in h


def test_auto_on_one_host_moves_kv_through_shm(tiny_model_dir, want):
    c = Cluster(tiny_model_dir, prefill_over=AUTO, decode_over=AUTO)
    try:
        for prompt, w in zip(PROMPTS, want):
            status, out = _complete(c, prompt)
            assert status == 200, out
            assert out["choices"][0]["token_ids"] == w
        r = _routes(c)
        # every landed byte came through shm; tcp carried nothing
        assert r["decode"]["shm"]["imms"] > 0 and r["decode"]["shm"]["imm_bytes"] > 0
        assert r["decode"]["tcp"]["imms"] == r["decode"]["tcp"]["imm_bytes"] == 0
        assert r["prefill"]["shm"]["bytes"] > 0 and r["prefill"]["tcp"]["bytes"] == 0
        assert r["prefill"]["shm"]["qps"] == r["decode"]["shm"]["qps"] == 1
        (peer,) = c.coordinator.peers
        assert c.decode.app[NODE].messenger.route(peer.conn) == ("shm", "")
        assert _metric(c.url, 'pdkv_nic_landed_bytes_total{') == r["decode"]["shm"]["imm_bytes"]
        wait_for(c.pools_full, 10, "every page back in both pools")
    finally:
        c.stop()


def test_a_peer_claiming_this_host_that_is_not_falls_back_to_tcp(tiny_model_dir, want, caplog):
    """The decode node's HELLO names this host but its shm connection info another boot id
    (fault injection): both nodes' host checks fail, both fall back to tcp saying why, and the
    requests are served with the colocated tokens, every byte through tcp."""
    caplog.set_level(logging.INFO, logger="pdkv.disagg.protocol")
    forged = {**AUTO, "messenger__fault_shm_host_id": "00000000-forged-boot-id"}
    c = Cluster(tiny_model_dir, prefill_over=AUTO, decode_over=forged)
    try:
        for prompt, w in zip(PROMPTS, want):
            status, out = _complete(c, prompt)
            assert status == 200, out
            assert out["choices"][0]["token_ids"] == w
        r = _routes(c)
        assert r["decode"]["tcp"]["imms"] > 0 and r["prefill"]["tcp"]["bytes"] > 0
        assert r["decode"]["shm"]["imms"] == r["prefill"]["shm"]["bytes"] == 0
        (peer,) = c.coordinator.peers
        via, why = c.decode.app[NODE].messenger.route(peer.conn)
        assert via == "tcp" and "another host" in why and "forged-boot-id" in why
        falls = [r.getMessage() for r in caplog.records if "falls back to tcp" in r.getMessage()]
        assert any(m.startswith("decode:") for m in falls) and any(m.startswith("prefill:") for m in falls)
        assert all("another host" in m for m in falls)
        wait_for(c.pools_full, 10, "every page back in both pools")
    finally:
        c.stop()


def test_a_grant_that_fails_to_map_fails_the_request_and_gives_back_its_pages(tiny_model_dir, want):
    """shm: the request whose grant the prefill process fails to map (fault injection) fails
    with an error naming it, every page comes back, and the next requests map and are served."""
    over = {"messenger__transport": "shm"}
    c = Cluster(tiny_model_dir, prefill_over={**over, "messenger__fault_shm_fail_maps": 1}, decode_over=over)
    try:
        status, out = _complete(c, PROMPTS[1])
        assert status == 500, out
        msg = str(out)
        assert "cannot grant the request's pages" in msg and "could not map the grant" in msg, msg
        assert "fault injection" in msg
        wait_for(c.pools_full, 10, "every page back in both pools")
        assert c.decode.app[NODE].messenger.stats()["refused_writes"] == 0
        for prompt, w in zip(PROMPTS, want):
            status, out = _complete(c, prompt)
            assert status == 200, out
            assert out["choices"][0]["token_ids"] == w
        wait_for(c.pools_full, 10, "every page back in both pools")
    finally:
        c.stop()


def test_auto_grants_go_through_tcp_once_a_mapping_fails(tiny_model_dir, want, caplog):
    """auto: the prefill process fails to map a grant (fault injection): that grant and every
    later one of the link are made through tcp instead, the decode node logs why, and every
    request, that one included, answers the colocated tokens."""
    caplog.set_level(logging.WARNING, logger="pdkv.disagg.decode")
    c = Cluster(tiny_model_dir, prefill_over={**AUTO, "messenger__fault_shm_fail_maps": 1}, decode_over=AUTO)
    try:
        for prompt, w in zip(PROMPTS, want):
            status, out = _complete(c, prompt)
            assert status == 200, out
            assert out["choices"][0]["token_ids"] == w
        r = _routes(c)
        assert r["decode"]["tcp"]["imms"] > 0 and r["decode"]["shm"]["imms"] == 0
        (peer,) = c.coordinator.peers
        via, why = c.decode.app[NODE].messenger.route(peer.conn)
        assert via == "tcp" and "could not map the grant" in why and "fault injection" in why
        wait_for(lambda: any("go through tcp from now on" in r.getMessage() for r in caplog.records), 10,
                 "the decode node's warning")
        wait_for(c.pools_full, 10, "every page back in both pools")
    finally:
        c.stop()
