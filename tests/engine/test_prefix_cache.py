"""Automatic prefix caching in the engine, with the tiny model: greedy output is token-for-token
the same with caching on and off; hits are counted in tokens; remote KV becomes matchable only
once it landed; the decode- and prefill-side reuse the disaggregated connectors will call."""

from __future__ import annotations

import random

import pytest

from pdkv.config import load_config
from pdkv.engine import RequestStatus, SamplingParams
from _connectors import PrefillOnly, RemoteKV, remote_pages

P = 4  # page size: prompts of a few dozen tokens span many pages
GREEDY = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
_rng = random.Random(15)
BASE = [_rng.randrange(3, 500) for _ in range(48)]
OTHER = [_rng.randrange(3, 500) for _ in range(48)]
PROMPTS = [
    BASE[:30],                 # the first of its prefix
    OTHER[:21],                # shares nothing (0 tokens)
    BASE[:2] + OTHER[:19],     # shares part of a page
    BASE[:12] + OTHER[30:41],  # shares whole pages (3)
    BASE[:30],                 # the whole prompt again (30 = 7 pages + 2: the partial page is computed)
    BASE[:32],
    BASE[:32],                 # a prompt of whole pages all cached: its last page is computed again
    BASE[:31],                 # ends inside a page another request filled
    BASE[:5],
    OTHER[:4] + BASE[4:20],    # BASE's pages 1.. after another first page: equal tokens, other KV
    OTHER[:4] + BASE[4:20],    # (a hash not chained over the parent would reuse BASE's page 1)
]


def _run(engine, together: bool) -> list[list[int]]:
    if together:
        return [o.output_token_ids for o in engine.generate(PROMPTS, GREEDY)]
    return [engine.generate([p], GREEDY)[0].output_token_ids for p in PROMPTS]


@pytest.mark.parametrize("together", [True, False], ids=["together", "one-after-another"])
def test_greedy_output_identical_with_caching_on_and_off(make_engine, together):
    # A budget of 16 tokens a step: requests arriving together are admitted over several steps,
    # so later ones find what earlier ones computed meanwhile.
    off = make_engine(page_size=P, num_pages=128, budget=16, chunk=8, prefix_caching=False)
    on = make_engine(page_size=P, num_pages=128, budget=16, chunk=8)
    assert on.stats()["prefix_caching"] and not off.stats()["prefix_caching"]
    want, got = _run(off, together), _run(on, together)
    assert got == want
    st = on.stats()
    assert st["prefix_cache_queries"] == sum(len(p) for p in PROMPTS)
    assert st["prefix_cache_hits"] > 0 and off.stats()["prefix_cache_hits"] == 0
    assert on.allocator.num_free == on.allocator.num_total and st["num_pages_cached"] > 0
    if not together:  # every hit is known: the longest whole-page prefix any earlier request computed
        assert st["prefix_cache_hits"] == _expected_hits(PROMPTS, want)


def _expected_hits(prompts, outputs) -> int:
    done: list[list[int]] = []  # earlier requests' prompt + outputs (their KV covers all but the last token)
    hits = 0
    for prompt, out in zip(prompts, outputs):
        best = 0
        for seq in done:
            k = 0
            while k < min(len(seq) - 1, len(prompt) - 1) and seq[k] == prompt[k]:
                k += 1
            best = max(best, k // P * P)
        hits += best
        done.append(prompt + out)
    return hits


def _count_fed(engine) -> list[int]:
    fed, execute = [], engine.runner.execute

    def counting(seqs, connector):
        fed.extend(len(s.token_ids) for s in seqs)
        return execute(seqs, connector)
    engine.runner.execute = counting
    return fed


def test_preemption_under_memory_pressure_recomputes_from_the_cache(make_engine):
    """A pool too small for every request at once: requests are preempted and recomputed, cached
    pages are evicted; the output is unchanged and the recomputes find pages in the cache (the
    engine feeds fewer tokens than without it)."""
    prompts = [BASE[:24] + [i + 3] * 6 for i in range(5)]
    params = SamplingParams(max_tokens=14, temperature=0, ignore_eos=True)
    off = make_engine(page_size=P, num_pages=22, chunk=8, prefix_caching=False)
    on = make_engine(page_size=P, num_pages=22, chunk=8)
    fed_off, fed_on = _count_fed(off), _count_fed(on)
    want = [o.output_token_ids for o in off.generate(prompts, params)]
    assert [o.output_token_ids for o in on.generate(prompts, params)] == want
    st = on.stats()
    assert st["num_preemptions"] > 0 and on.allocator.num_evictions > 0
    assert sum(fed_on) < sum(fed_off)
    assert on.allocator.num_free == on.allocator.num_total


def _land(src_engine, src_pages, dst_engine, dst_pages):
    for layer in range(dst_engine.kv.num_layers):
        dst_engine.kv.layer(layer)[dst_pages] = src_engine.kv.layer(layer)[src_pages]


def _prefilled(engine, rid, prompt):
    """Runs ``prompt``'s prefill in ``engine`` (a second request that stays running)."""
    engine.add_request(rid, prompt, SamplingParams(max_tokens=2, temperature=0, ignore_eos=True))
    while engine.requests[rid].num_computed_tokens < len(prompt):
        engine.step()
    return engine.requests[rid].pages


def test_remote_pages_are_matched_only_once_landed(make_engine):
    prompt = BASE[:29]
    ref = make_engine(page_size=P, num_pages=64, prefix_caching=False)
    want = ref.generate([prompt], GREEDY)[0].output_token_ids
    src = _prefilled(ref, "src", prompt)
    dec = make_engine(page_size=P, num_pages=64)
    dec.set_connector(RemoteKV(ids={"d"}))
    dec.add_request("d", prompt, GREEDY)
    pages = remote_pages(dec, "d")
    assert dec.cached_prefix_tokens(prompt) == 0  # pinned, a writer may still fill them
    _land(ref, src[:len(pages)], dec, pages)
    assert dec.cached_prefix_tokens(prompt) == 0  # written, but not declared landed
    dec.remote_kv_ready("d")
    assert dec.cached_prefix_tokens(prompt) == 28  # the landed step publishes the full pages
    outs = []
    while dec.has_unfinished():
        outs += dec.step()
    assert outs[-1].output_token_ids == want
    # A local request now reuses the landed pages and computes only the last token.
    out = dec.generate([prompt], GREEDY)[0]
    assert out.output_token_ids == want and dec.stats()["prefix_cache_hits"] == 28


def test_aborted_remote_request_publishes_nothing(make_engine):
    dec = make_engine(page_size=P, num_pages=64)
    prompt = BASE[:20]
    dec.set_connector(RemoteKV())
    dec.add_request("d", prompt, GREEDY)
    dec.abort("d", quarantine=True)
    dec.release("d")
    assert dec.cached_prefix_tokens(prompt) == 0 and dec.allocator.num_evictable == 0
    assert dec.allocator.num_free == dec.allocator.num_total


def test_decode_side_reuse_asks_only_for_the_missing_pages(make_engine):
    """The disaggregated decode interface: a prompt whose first pages this node holds reserves
    (and has written) only the pages after them, and decodes the same tokens."""
    first, second = BASE[:21], BASE[:16] + OTHER[:9]
    ref = make_engine(page_size=P, num_pages=64, prefix_caching=False)
    want = ref.generate([second], GREEDY)[0].output_token_ids
    src = _prefilled(ref, "src", second)
    dec = make_engine(page_size=P, num_pages=64)
    dec.generate([first], GREEDY)  # caches first's pages: 16 tokens shared with second
    dec.set_connector(RemoteKV(ids={"d"}, reuse_cached=True))
    dec.add_request("d", second, GREEDY)
    pages = remote_pages(dec, "d")
    req = dec.requests["d"]
    assert req.num_cached_tokens == 16 and req.num_external_tokens == len(second) - 1 - 16
    assert pages == req.pages[16 // P:] and len(pages) == -(-(len(second) - 1) // P) - 16 // P
    assert all(dec.allocator.is_pinned(p) for p in pages)
    assert not any(dec.allocator.is_pinned(p) for p in req.pages[:16 // P])
    _land(ref, src[16 // P:16 // P + len(pages)], dec, pages)  # only the missing pages move
    dec.remote_kv_ready("d")
    outs = []
    while dec.has_unfinished():
        outs += dec.step()
    assert outs[-1].output_token_ids == want
    assert dec.allocator.num_free == dec.allocator.num_total


def test_prefill_side_reuse_computes_only_the_rest(make_engine):
    """The disaggregated prefill interface: a prefill-only request reuses its own cached prefix
    and computes only the rest; its pages then hold the same KV a full computation gives."""
    import torch

    prompt = BASE[:26]
    full = make_engine(page_size=P, num_pages=64, prefix_caching=False)
    full.set_connector(PrefillOnly())
    full.add_request("x", prompt, SamplingParams(max_tokens=1))
    while full.has_work():
        full.step()
    pre = make_engine(page_size=P, num_pages=64)
    pre.generate([BASE[:18]], GREEDY)
    pre.set_connector(PrefillOnly(reuse_cached=True))
    pre.add_request("y", prompt, SamplingParams(max_tokens=1))
    assert pre.requests["y"].num_cached_tokens == 16
    fed = _count_fed(pre)
    done = []
    while pre.has_work():
        done += [o.request_id for o in pre.step() if o.finish_reason == "prefilled"]
    assert done == ["y"] and sum(fed) == len(prompt) - 16
    a, b = full._held["x"][0], pre._held["y"][0]
    n = len(prompt)
    for layer in range(pre.kv.num_layers):
        for pos in range(n):
            ka = full.kv.layer(layer)[a[pos // P]][:, :, pos % P]
            kb = pre.kv.layer(layer)[b[pos // P]][:, :, pos % P]
            assert torch.allclose(ka, kb, atol=1e-5), f"layer {layer} position {pos}"
    assert pre.stats()["prefix_cache_hits"] == 16  # generate's lookup found nothing, this one 16 tokens
    pre.release("y")
    full.release("x")
    assert pre.allocator.num_free == pre.allocator.num_total


def test_prefix_caching_config_switch(tmp_path):
    assert load_config(None, []).kv_cache.prefix_caching is True
    assert load_config(None, ["kv_cache.prefix_caching=false"]).kv_cache.prefix_caching is False
    bad = tmp_path / "bad.yaml"
    bad.write_text("kv_cache:\n  prefix_caching: maybe\n")
    with pytest.raises(Exception, match="kv_cache.prefix_caching"):
        load_config(str(bad), [])


def test_requests_keep_their_state_machine(make_engine):
    eng = make_engine(page_size=P, num_pages=64)
    eng.generate([BASE[:20]], GREEDY)
    eng.add_request("a", BASE[:20], GREEDY)
    assert eng.requests["a"].num_cached_tokens == 16  # the peek the connector sees at admission
    eng.step()
    assert eng.requests["a"].status == RequestStatus.RUNNING and eng.requests["a"].num_computed_tokens == 20
    eng.abort("a")
    eng.step()
    assert eng.allocator.num_free == eng.allocator.num_total
    cached = eng.stats()["num_pages_cached"]
    assert cached > 0 and eng.allocator.evict_all() == cached  # KV changed behind its back: forget it
    assert eng.cached_prefix_tokens(BASE[:20]) == 0 and eng.stats()["num_pages_cached"] == 0


def test_prompts_differing_only_in_a_pages_last_token_never_share_that_page(make_engine):
    """Every token of a page is in its hash, the last one too: B equals A but for token 7, the
    last of page 1 (page size 4), so after A ran B finds page 0 cached and not page 1."""
    a = BASE[:13]
    b = a[:7] + [a[7] % 400 + 1] + a[8:]
    plain = make_engine(page_size=P, num_pages=64, prefix_caching=False)
    want = plain.generate([b], GREEDY)[0].output_token_ids
    eng = make_engine(page_size=P, num_pages=64)
    eng.generate([a], GREEDY)
    assert eng.cached_prefix_tokens(a) == 12  # A's three whole prompt pages
    assert eng.cached_prefix_tokens(b) == 4
    assert eng.generate([b], GREEDY)[0].output_token_ids == want
    assert eng.stats()["prefix_cache_hits"] == 4


def _salt(engine) -> bytes:
    return engine.scheduler.cache.salt


def test_the_hash_salt_changes_with_the_model_and_the_dtype(make_engine, tiny_model_dir, tmp_path):
    """Equal prompts hash equally only on nodes whose KV for them is equal: the same checkpoint
    and dtype give the same salt (and so the same page hashes), another dtype, another config
    with the same weight files' names and sizes (a rope_theta change), or another page size
    give another one."""
    import json
    import shutil

    from pdkv.kv.prefix_cache import chain_hashes

    base = make_engine(page_size=P, num_pages=16)
    assert _salt(make_engine(page_size=P, num_pages=32)) == _salt(base)  # the pool's size is not in it
    other = tmp_path / "other-rope"
    shutil.copytree(tiny_model_dir, other)
    cfg = json.loads((other / "config.json").read_text())
    cfg["rope_theta"] = float(cfg.get("rope_theta", 10000.0)) * 2
    (other / "config.json").write_text(json.dumps(cfg))
    salts = {"base": _salt(base), "bfloat16": _salt(make_engine(page_size=P, num_pages=16, dtype="bfloat16")),
             "rope": _salt(make_engine(other, page_size=P, num_pages=16)),
             "page size": _salt(make_engine(page_size=2 * P, num_pages=16))}
    assert len(set(salts.values())) == len(salts), salts
    pages = {k: chain_hashes(BASE[:8], P, s, [], 2) for k, s in salts.items() if k != "page size"}
    assert len({h[0] for h in pages.values()}) == len(pages)  # no page of one matches the other's
