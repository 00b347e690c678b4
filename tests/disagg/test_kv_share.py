"""disagg.kv_handoff on one host (shm): ``share`` computes the KV in the decode node's pages
(no page copied, counted in the prefill node's transport), ``copy`` writes them; both land the
colocated cache's KV and the same tokens."""
from __future__ import annotations

import os
import json
import threading
import urllib.request

import pytest
import torch

from _cluster import Cluster, colocated_kv, hold_kv_on_landing, wait_for
from pdkv.config import ConfigError, config_from_dict
from pdkv.server.app import NODE
from test_equality import PROMPTS, _colocated, _complete

PAGE_SIZE = 16  # the tiny model's page is then 4096 bytes: whole OS pages, so share applies


@pytest.mark.parametrize("layout", ["HND", "NHD"])
@pytest.mark.parametrize("chunk,layerwise", [(4, True), (64, True), (4, False)])
@pytest.mark.parametrize("handoff", ["copy", "share"])
def test_tokens_and_landed_kv_equal_colocated_with_and_without_a_copy(tiny_model_dir, handoff, chunk, layerwise,
                                                                       layout, transport="shm"):
    over = {"kv_cache__page_size": PAGE_SIZE, "kv_cache__layout": layout}
    want_tokens, _ = _colocated(tiny_model_dir)
    want_kv = colocated_kv(tiny_model_dir, PROMPTS, **over)
    shm = {"messenger__transport": transport, "disagg__kv_handoff": handoff}
    # NOTE: both prefix caches off: the counts below are exact only if every page is computed
    c = Cluster(tiny_model_dir, prefill_over={**over, **shm, "scheduler__chunk_size": chunk,
                                              "messenger__layerwise": layerwise,
                                              "kv_cache__prefix_caching": False},
                decode_over={**over, **shm, "kv_cache__prefix_caching": False})
    landed_kv = hold_kv_on_landing(c.coordinator, c.decode_engine)
    try:
        name = c.model_name()
        results = [None] * len(PROMPTS)
        threads = [threading.Thread(target=_complete, args=(c.url, name, p, results, i))
                   for i, p in enumerate(PROMPTS)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(90)
        assert all(r is not None for r in results)
        assert [(r["choices"][0]["token_ids"], r["choices"][0]["text"]) for r in results] == want_tokens
        for r, p in zip(results, PROMPTS):
            _, (got,) = landed_kv[r["id"] + "-0"]
            for layer, (g, w) in enumerate(zip(got, [w[:, :len(p) - 1] for w in want_kv[tuple(p)]])):
                torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5,
                                           msg=lambda m: f"{len(p)}-token prompt, layer {layer}: {m}")
        pm = c.prefill.app[NODE].coordinator.m
        L = c.prefill_engine.kv.num_layers
        pages = sum(-(-(len(p) - 1) // PAGE_SIZE) for p in PROMPTS)
        wait_for(lambda: pm.stats()["writes_done"] >= pages * L + len(PROMPTS), 10, "every write counted")
        st = pm.stats()
        page_bytes = c.prefill_engine.kv.page_nbytes
        if handoff == "share":  # every page computed in place: only the hidden rows were copied
            assert (st["shared_writes"], st["copied_writes"]) == (pages * L, len(PROMPTS))
            assert st["copied_bytes"] == len(PROMPTS) * 64 * 4
        else:
            assert (st["shared_writes"], st["copied_writes"]) == (0, pages * L + len(PROMPTS))
            assert st["copied_bytes"] == pages * L * page_bytes + len(PROMPTS) * 64 * 4
        assert c.decode.app[NODE].messenger.stats()["imms"] == pages * L + len(PROMPTS)  # same count
        # the prefill node's pages are its own again (nothing of the decode node aliased there)
        assert c.prefill_engine.scheduler.cache is None
    finally:
        c.stop()
    assert c.pools_full()


def test_share_on_auto_links_that_took_shm(tiny_model_dir):
    """transport auto: the link the HELLOs found on one host went through shm, so the share
    applies there as on shm itself (every page computed in place, counted)."""
    test_tokens_and_landed_kv_equal_colocated_with_and_without_a_copy(tiny_model_dir, "share", 4, True, "HND",
                                                                       transport="auto")


def test_share_after_share_reuses_pages_that_are_the_prefill_nodes_own_again(tiny_model_dir):
    """Requests one after the other reuse the prefill node's page slots: each lands right, so an
    alias never outlives its request (a stale one would put the next request's KV in the old
    decode pages, and the decode node's pages would read wrong)."""
    over = {"kv_cache__page_size": PAGE_SIZE, "kv_cache__prefix_caching": False}
    shm = {"messenger__transport": "shm", "disagg__kv_handoff": "share"}
    want_kv = colocated_kv(tiny_model_dir, PROMPTS, kv_cache__page_size=PAGE_SIZE)
    c = Cluster(tiny_model_dir, prefill_over={**over, **shm}, decode_over={**over, **shm})
    landed_kv = hold_kv_on_landing(c.coordinator, c.decode_engine)
    try:
        name = c.model_name()
        for p in PROMPTS[::-1]:
            res = [None]
            _complete(c.url, name, p, res, 0)
            _, (got,) = landed_kv[res[0]["id"] + "-0"]
            for g, w in zip(got, want_kv[tuple(p)]):
                torch.testing.assert_close(g, w[:, :len(p) - 1], rtol=1e-5, atol=1e-5)
        st = c.prefill.app[NODE].coordinator.m.stats()
        assert st["shared_writes"] > 0 and st["copied_writes"] == len(PROMPTS)
    finally:
        c.stop()
    assert c.pools_full()


@pytest.mark.parametrize("over,why", [
    ({"messenger": {"transport": "tcp"}}, "only the shm transport .or auto.s links through it. maps"),
    ({"messenger": {"transport": "shm"}, "parallel": {"tp": 2}}, "parallel.tp > 1"),
    ({"messenger": {"transport": "shm"}, "model": {"device": "cuda:0"}}, "on a GPU"),
    ({"messenger": {"transport": "shm", "staging": "cpu"}}, "staging cpu"),
])
def test_share_without_what_it_needs_is_a_config_error_naming_it(over, why):
    with pytest.raises(ConfigError, match=f"disagg.kv_handoff must be copy.*{why}"):
        config_from_dict({"role": "prefill", "disagg": {"kv_handoff": "share"}, **over})
    with pytest.raises(ConfigError, match="disagg.kv_handoff must be one of auto, copy, share"):
        config_from_dict({"role": "prefill", "disagg": {"kv_handoff": "zero"}})


def test_decode_sigkilled_while_prefill_computes_in_its_pages(tiny_model_dir, tmp_path):
    """The decode node dies mid-request: the prefill node's pages are its own again (nothing of
    the dead node's memory stays mapped here), its pool is full, and it shares with the next."""
    import signal
    import time

    from _cluster import assert_colocated_answer, make_engine, node_config, serve_node
    from _procs import NodeProc, free_port, node_dict
    from test_kill import _post, _shm_files

    share = {"messenger__transport": "shm", "disagg__kv_handoff": "share", "kv_cache__page_size": PAGE_SIZE,
             "kv_cache__prefix_caching": False}
    pcfg = node_config(tiny_model_dir, "prefill", messenger__lease_s=30.0, **share)
    peng = make_engine(pcfg)
    with serve_node(pcfg, peng) as pre:
        pnode = pre.app[NODE]
        own = _shm_files()
        hook = peng.connector.after_layer
        # FAULT INJECTION (slow prefill): 20 ms per layer, so the kill lands mid-request
        peng.connector.after_layer = lambda layer: (time.sleep(0.02), hook(layer))
        d = node_dict(tiny_model_dir, "decode", port=free_port(), peers=[f"127.0.0.1:{pnode.control_port}"],
                      chunk=8, transport="shm", page_size=PAGE_SIZE)
        d["disagg"]["kv_handoff"] = "share"
        dec = NodeProc(tmp_path, "decode", d)
        try:
            dec.wait_healthy()
            name = json.loads(urllib.request.urlopen(dec.url + "/v1/models").read())["data"][0]["id"]

            def doomed():  # its server is killed under it
                try:
                    _post(dec.url, {"model": name, "prompt": list(range(5, 150)), "max_tokens": 4}, 10)
                except OSError:
                    pass
            threading.Thread(target=doomed, daemon=True).start()
            coord = pnode.coordinator
            wait_for(lambda: any(j.shared for j in list(coord.jobs.values())), 20, "pages shared")
            assert _shm_files() - own  # the decode node's pages are mapped here (twice: grant, alias)
            dec.signal(signal.SIGKILL)
            wait_for(lambda: peng.allocator.num_free == peng.allocator.num_total and not coord.jobs, 10,
                     "prefill pool full")
            wait_for(lambda: not _shm_files() - own, 10, "the dead node's pages unmapped here")
        finally:
            dec.stop()
        peng.connector.after_layer = hook
        dcfg = node_config(tiny_model_dir, "decode", messenger__prefill_peers=[f"127.0.0.1:{pnode.control_port}"],
                           **share)
        with serve_node(dcfg, make_engine(dcfg)) as d2:
            name = json.loads(urllib.request.urlopen(d2.url + "/v1/models").read())["data"][0]["id"]
            assert_colocated_answer(d2.url, name, tiny_model_dir, range(5, 60), 3)
        assert pnode.coordinator.m.stats()["shared_writes"] > 0


@pytest.mark.parametrize("over,want", [
    ({}, "copy"),  # tcp
    ({"messenger": {"transport": "shm"}}, "copy"),  # the prefill prefix cache saves compute: kept
    ({"messenger": {"transport": "shm"}, "kv_cache": {"prefix_caching": False}}, "share"),
    ({"messenger": {"transport": "shm"}, "kv_cache": {"prefix_caching": False}, "parallel": {"tp": 2}}, "copy"),
    ({"messenger": {"transport": "shm"}, "disagg": {"kv_handoff": "share"}}, "share"),
    ({"messenger": {"transport": "shm"}, "kv_cache": {"prefix_caching": False},
      "disagg": {"kv_handoff": "copy"}}, "copy"),
])
def test_auto_shares_only_where_it_applies_and_costs_no_prefix_cache(over, want):
    from pdkv.disagg.kv_share import handoff

    assert handoff(config_from_dict({"role": "prefill", **over})) == want


def test_prefill_sigkilled_while_computing_in_the_decode_nodes_pages(tmp_path):
    """The prefill process dies mid-request while its forward passes write into the decode
    node's pages: the decode node fails the request as transient, every page comes back, only
    its own process maps its memory, and it answers the next prompt by itself."""
    import signal

    from _cluster import make_engine, node_config, serve_node
    from _procs import NodeProc, free_port, node_dict
    from test_kill import _post
    from pdkv.tiny_model import make_tiny_model

    # slow enough to be killed mid-prefill on CPU: ~60 chunks of 16 tokens through 8 layers of 512
    model = make_tiny_model(tmp_path / "m", hidden_size=512, num_layers=8, num_heads=8, num_kv_heads=2,
                            intermediate_size=1536, vocab_size=4096, max_position_embeddings=2048, seed=0)
    cport = free_port()
    d = node_dict(model, "prefill", port=free_port(), control_port=cport, transport="shm", page_size=PAGE_SIZE,
                  num_pages=128)
    d["disagg"] = {"kv_handoff": "share"}
    d["kv_cache"]["prefix_caching"] = False
    pre = NodeProc(tmp_path, "prefill", d)
    try:
        pre.wait_healthy()
        dcfg = node_config(model, "decode", messenger__prefill_peers=[f"127.0.0.1:{cport}"], messenger__lease_s=30.0,
                           messenger__transport="shm", disagg__kv_handoff="share", kv_cache__page_size=PAGE_SIZE,
                           kv_cache__num_pages=128,
                           disagg__prefill_retries=0)  # the failure path (a retry prefills it locally)
        eng = make_engine(dcfg)
        with serve_node(dcfg, eng) as dec:
            coord = dec.app[NODE].coordinator
            name = json.loads(urllib.request.urlopen(dec.url + "/v1/models").read())["data"][0]["id"]
            box = {}
            t = threading.Thread(target=lambda: box.setdefault("r", _post(dec.url, {
                "model": name, "prompt": list(range(5, 1005)), "max_tokens": 2}, 60, headers=True)))
            t.start()
            wait_for(lambda: coord.slots, 20, "PREFILL sent")
            assert _maps_of(pre.proc.pid, own=os.getpid())  # the granted pages are mapped there
            pre.signal(signal.SIGKILL)
            t.join(30)
            status, _body, headers = box["r"]
            assert status == 503 and headers.get("Retry-After")
            wait_for(lambda: eng.allocator.num_free == eng.allocator.num_total, 10, "decode pool full")
            assert not coord.slots
            assert _post(dec.url, {"model": name, "prompt": [5], "max_tokens": 2})[0] == 200
    finally:
        pre.stop()


def _maps_of(pid: int, own: int) -> int:
    """Bytes of process ``own``'s unnamed /dev/shm files that process ``pid`` maps."""
    def files(p):
        out = {}
        with open(f"/proc/{p}/maps") as f:
            for line in f:
                parts = line.split(maxsplit=5)
                if len(parts) == 6 and parts[5].startswith("/dev/shm/#"):
                    lo, hi = (int(x, 16) for x in parts[0].split("-"))
                    out[int(parts[4])] = out.get(int(parts[4]), 0) + hi - lo
        return out
    mine = files(own)
    return sum(n for ino, n in files(pid).items() if ino in mine)
