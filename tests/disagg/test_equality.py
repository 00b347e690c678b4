"""Greedy tokens through prefill + decode (tcp, layer-wise) equal the colocated engine's, and the
hidden state the prefill node sends equals the colocated one at the same position."""
from __future__ import annotations

from pdkv.server.app import NODE

import json
import sys
import threading
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import torch

from _cluster import Cluster, colocated_kv, hold_kv_on_landing, keep_landed_hidden, make_engine, node_config, wait_for
from pdkv.disagg.writes import pages_to_send
from pdkv.engine import SamplingParams

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "messenger"))
from fabrics import MREP_DOUBLE  # noqa: E402 - builds the FI_MR_ENDPOINT test double, sets FI_PROVIDER_PATH

PROMPTS = [list(range(3, 3 + n)) for n in (2, 5, 13, 21, 40)] + [[7] * 9, list(range(100, 131))]


def _colocated(model_dir):
    """Reference tokens and final hidden states at position len(prompt) - 2."""
    cfg = node_config(model_dir, "colocated")
    eng = make_engine(cfg)
    want_hidden = {}

    def listen(batch, hidden):  # hidden: [num_tokens, hidden_size], rows in batch order
        for e in batch.entries:
            target = e.request.num_prompt_tokens - 2
            if hidden is not None and e.start <= target < e.start + e.num_tokens:
                want_hidden[tuple(e.request.prompt_token_ids)] = hidden[e.row + target - e.start].clone()
    eng.connector.after_forward = listen  # the colocated engine's no-op connector, observed
    outs = eng.generate(PROMPTS, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
    assert all(len(o.output_token_ids) == 6 for o in outs)
    # the text of the same incremental detokenizer the server uses (token ids do not cross the API)
    return [(o.output_token_ids, o.text) for o in outs], want_hidden


def _complete(url, name, prompt, results, i):
    body = json.dumps({"model": name, "prompt": prompt, "max_tokens": 6, "temperature": 0,
                       "ignore_eos": True, "return_token_ids": True}).encode()
    req = urllib.request.Request(url + "/v1/completions", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        results[i] = json.loads(r.read())


def test_pages_to_send_covers_each_page_once_whatever_the_chunking():
    rng = np.random.default_rng(0)
    for _ in range(200):
        n, p = int(rng.integers(1, 60)), int(rng.choice([1, 2, 4, 8, 16]))
        sent, start = [], 0
        while start < n:
            k = int(rng.integers(1, n - start + 1))
            sent.extend(pages_to_send(start, k, p, start + k == n))
            start += k
        assert sent == list(range(-(-n // p))), (n, p, sent)


@pytest.mark.parametrize("layout", ["HND", "NHD"])
@pytest.mark.parametrize("chunk,layerwise", [(4, True), (64, True), (4, False), (64, False)])
@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_greedy_tokens_hidden_and_kv_equal_colocated(tiny_model_dir, chunk, layerwise, layout, transport,
                                                    messenger=None):
    """``messenger``: overrides of both nodes' messenger section (default: ``transport``). shm: the
    decode node's KV, hidden rows and pages are shared memory; each request's granted pages are
    mapped into the prefill node's transport and written there with a memcpy."""
    messenger = messenger or ({"transport": transport} if transport != "tcp" else None)
    want_tokens, want_hidden = _colocated(tiny_model_dir)
    want_kv = colocated_kv(tiny_model_dir, PROMPTS)  # HND: read_kv compares layouts position by position
    over = {"scheduler__chunk_size": chunk, "messenger__layerwise": layerwise, "kv_cache__layout": layout}
    both = {f"messenger__{k}": v for k, v in (messenger or {}).items()}
    # NOTE: the decode node's prefix cache off: these prompts share prefixes and arrive together,
    # so with it on, how many pages move depends on which lands first (the exact counts below
    # would not hold); the prefill node's stays on (the pages it reuses are sent too)
    c = Cluster(tiny_model_dir, prefill_over={**over, **both},
                decode_over={"kv_cache__layout": layout, "kv_cache__prefix_caching": False, **both})
    assert c.decode.app[NODE].messenger.transport == (messenger or {}).get("transport", "tcp")
    landed_kv = hold_kv_on_landing(c.coordinator, c.decode_engine)
    hs = keep_landed_hidden(c.coordinator)
    try:
        name = json.loads(urllib.request.urlopen(c.url + "/v1/models").read())["data"][0]["id"]
        results = [None] * len(PROMPTS)
        threads = [threading.Thread(target=_complete, args=(c.url, name, p, results, i))
                   for i, p in enumerate(PROMPTS)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(90)
        got = [None if r is None else r["usage"] for r in results]
        assert all(r is not None for r in results), got
        assert [r["usage"]["completion_tokens"] for r in results] == [6] * len(PROMPTS)
        assert [(r["choices"][0]["token_ids"], r["choices"][0]["text"]) for r in results] == want_tokens
        # the hidden state that arrived (one per remote request; a 2-token prompt sends 1 row)
        assert len(hs) == len(PROMPTS)
        by_prompt = {}
        for r, p in zip(results, PROMPTS):
            by_prompt[tuple(p)] = hs[r["id"] + "-0"]
        for p in PROMPTS:
            torch.testing.assert_close(by_prompt[tuple(p)], want_hidden[tuple(p)], rtol=1e-4, atol=1e-5)
        # the KV that landed, page by page in each request's logical order, before its last
        # prompt token ran: the colocated cache's first len-1 positions, every layer (token
        # equality alone cannot see two pages swapped: rotary keys make attention order-blind)
        assert sorted(landed_kv) == sorted(r["id"] + "-0" for r in results)
        for r, p in zip(results, PROMPTS):
            _, (got,) = landed_kv[r["id"] + "-0"]
            want = [w[:, :len(p) - 1] for w in want_kv[tuple(p)]]
            for layer, (g, w) in enumerate(zip(got, want)):
                torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5,
                                           msg=lambda m: f"{len(p)}-token prompt, layer {layer}: {m}")
        # the writes were driven by the layer counter: every forward moved it by num_layers
        pc = c.prefill.app[NODE].coordinator
        L = c.prefill_engine.kv.num_layers
        per_step = L if layerwise else L + 1  # after-forward: one more bump when the forward returned
        assert pc.counter.value() % per_step == 0 and pc.counter.value() > 0
        pages = sum(-(-(len(p) - 1) // 4) for p in PROMPTS)
        # the decode node may answer before the prefill node's poller counted its last completions
        wait_for(lambda: pc.m.stats()["writes_done"] >= pages * L + len(PROMPTS), 10, "every write counted")
        st = pc.m.stats()
        assert st["queued"] == 0
        # every page once per layer, plus one hidden-state row per request: nothing more, nothing less
        assert st["writes_posted"] == st["writes_done"] == pages * L + len(PROMPTS)
        assert c.decode.app[NODE].messenger.stats()["imms"] == pages * L + len(PROMPTS)
        # metrics on both sides: bytes moved agree; every request's exposed transfer was measured
        def metric(url, name):
            text = urllib.request.urlopen(url + "/metrics").read().decode()
            return [float(x.split()[-1]) for x in text.splitlines() if x.startswith(name)]
        kv_bytes = c.prefill_engine.kv.page_nbytes * pages * L + len(PROMPTS) * 64 * 4
        assert metric(c.prefill.url, "pdkv_kv_transfer_bytes_total") == [kv_bytes]
        assert metric(c.url, "pdkv_kv_transfer_bytes_total") == [kv_bytes]
        assert metric(c.url, "pdkv_kv_transfer_exposed_seconds_count") == [len(PROMPTS)]
        assert metric(c.url, "pdkv_queue_admission_seconds_count") == [len(PROMPTS)]
        assert metric(c.prefill.url, "pdkv_queue_prefill_seconds_count") == [len(PROMPTS)]
    finally:
        c.stop()
    assert c.prefill_engine.allocator.num_free == c.prefill_engine.allocator.num_total
    assert c.decode_engine.allocator.num_free == c.decode_engine.allocator.num_total


@pytest.mark.parametrize("layerwise", [True, False])
def test_layer_writes_post_while_later_layers_compute(tiny_model_dir, layerwise):
    """The C poller posts layer l's pages as soon as the runner's hook bumped the counter past
    layer l, during the forward pass: layer l's hook waits (a bounded hang guard) until the
    messenger posted l + 1 layers' batches, so passing proves they left while later layers were
    still to compute. In after-forward mode nothing leaves before the forward returns."""
    import time

    c = Cluster(tiny_model_dir, prefill_over={"messenger__layerwise": layerwise, "scheduler__chunk_size": 64})
    try:
        peng = c.prefill_engine
        pc = c.prefill.app[NODE].coordinator
        L = peng.kv.num_layers
        hook, seen = peng.connector.after_layer, []

        def waiting_hook(layer):
            hook(layer)
            posted = pc.m.stats()["posted_batches"]
            if layerwise:  # one chunk (27 tokens < 64), so one batch per layer
                end = time.monotonic() + 5.0  # hang guard only
                while posted < layer + 1 and time.monotonic() < end:
                    time.sleep(0.001)
                    posted = pc.m.stats()["posted_batches"]
            elif layer == L - 1:  # give the poller a chance to post early (it must not)
                time.sleep(0.05)
                posted = pc.m.stats()["posted_batches"]
            seen.append((layer, posted))
        peng.connector.after_layer = waiting_hook
        body = json.dumps({"model": c.model_name(), "prompt": list(range(3, 30)), "max_tokens": 1}).encode()
        urllib.request.urlopen(urllib.request.Request(c.url + "/v1/completions", body,
                                                      {"Content-Type": "application/json"}), timeout=30).read()
        assert [layer for layer, _ in seen] == list(range(L))
        if layerwise:  # layer l's pages left inside layer l's hook: before layer l + 1 ran
            assert [n for _, n in seen] == list(range(1, L + 1)), seen
        else:
            assert all(n == 0 for _, n in seen), seen
        assert pc.m.stats()["posted_batches"] == L
    finally:
        c.stop()


def test_decode_admission_waits_for_pages(tiny_model_dir):
    """A decode pool that holds one request at a time: the others wait in the admission queue
    (nothing fails) and every answer still equals the colocated one."""
    want, _ = _colocated(tiny_model_dir)
    c = Cluster(tiny_model_dir, decode_over={"kv_cache__num_pages": 16})  # 64 tokens: one 46-token request
    try:
        name = c.model_name()
        results = [None] * len(PROMPTS)
        threads = [threading.Thread(target=_complete, args=(c.url, name, p, results, i))
                   for i, p in enumerate(PROMPTS)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(90)
        assert [(r["choices"][0]["token_ids"], r["choices"][0]["text"]) for r in results] == want
    finally:
        c.stop()
    assert c.pools_full()


def admit_test_double(monkeypatch, provider: str) -> None:
    """The FI_MR_ENDPOINT test double (tests/messenger/fabrics.py) is no provider the config
    knows: admitted to its list for one test."""
    if provider == MREP_DOUBLE:
        import importlib

        validate = importlib.import_module("pdkv.config.validate")  # the module, not its function
        monkeypatch.setattr(validate, "LIBFABRIC_PROVIDERS", (*validate.LIBFABRIC_PROVIDERS, provider))


def libfabric_messenger(provider: str, domains=None) -> dict:
    """The messenger section of a node on libfabric ``provider`` (tcp-based ones on the loopback
    interface, or ``domains``); skipped where this build or host lacks it (failed under
    PDKV_REQUIRE_LIBFABRIC=1)."""
    import os

    from pdkv._messenger import HAVE_LIBFABRIC, Messenger
    from pdkv.transports import LibfabricOptions

    domains = list(domains) if domains is not None else [] if provider == "shm" else ["lo"]
    try:
        if not HAVE_LIBFABRIC:
            raise RuntimeError("pdkv built without libfabric")
        Messenger("libfabric", 1, LibfabricOptions(provider=provider, domains=tuple(domains))).close()
    except Exception as e:  # noqa: BLE001 - the reason is the skip's
        if os.environ.get("PDKV_REQUIRE_LIBFABRIC") == "1":
            raise
        pytest.skip(f"libfabric provider {provider}: {e}")
    return {"transport": "libfabric", "libfabric": {"provider": provider, "domains": domains}}


@pytest.mark.parametrize("provider", ["tcp;ofi_rxm", "shm", MREP_DOUBLE])
def test_greedy_tokens_hidden_and_kv_equal_colocated_over_libfabric(tiny_model_dir, provider, monkeypatch):
    """The same equality over the libfabric transport: every page a write of its own MR's range
    (one per request, layer and run of pages), immediates as remote CQ data. MREP_DOUBLE: the
    same under FI_MR_ENDPOINT (every MR bound to its endpoint), over the test double."""
    admit_test_double(monkeypatch, provider)
    test_greedy_tokens_hidden_and_kv_equal_colocated(tiny_model_dir, 4, True, "HND", "libfabric",
                                                     messenger=libfabric_messenger(provider))
