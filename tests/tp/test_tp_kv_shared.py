"""Rank 0 sees every rank's KV cache: the pages rank 1 wrote during its forward pass are readable
in rank 0 through its shared mapping (engine.tp.regions), and hold exactly rank 1's heads of the
K/V that the one-process engine computes."""

from __future__ import annotations

import ctypes

import torch

from pdkv.engine import SamplingParams


def _prefill(engine, rid: str, prompt: str) -> list[int]:
    """Runs ``rid`` until its first token; returns its pages (still held: max_tokens > 1)."""
    engine.add_request(rid, prompt, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    while not engine.requests[rid].output_token_ids:
        engine.step()
    return list(engine.requests[rid].pages)


def test_rank1_pages_visible_in_rank0(tp, llama_pair):
    one, two = llama_pair
    prompt = tp.PROMPTS[1]
    pages1, pages2 = _prefill(one, "kv", prompt), _prefill(two, "kv", prompt)
    try:
        # NOTE: not the same page ids: the session's two engines served other files' prompts
        # before this one, in an order the test workers choose; each engine's own pages are read
        assert len(pages1) == len(pages2)
        regions = two.tp.regions
        assert [r.rank for r in regions] == [0, 1]
        assert [r.kv_heads for r in regions] == [(0,), (1,)]
        assert regions[0].address == two.kv.data_ptr(0)  # rank 0's region is the engine's own cache
        assert len({r.address for r in regions}) == 2 and all(r.nbytes == two.kv.nbytes for r in regions)
        n_tokens = len(two.requests["kv"].prompt_token_ids)
        for layer in range(two.kv.num_layers):
            for rank, region in enumerate(regions):
                # HND page: [2, local heads, P, D]; the TP1 cache holds both heads.
                mine = region.cache.layer(layer)[pages2]  # [pages, 2, 1, P, D]
                full = one.kv.layer(layer)[pages1][:, :, rank:rank + 1]
                flat_mine = mine.transpose(0, 2).reshape(2, -1, two.kv.head_dim)[:, :n_tokens]
                flat_full = full.transpose(0, 2).reshape(2, -1, two.kv.head_dim)[:, :n_tokens]
                assert flat_mine.abs().sum() > 0  # really written, not zero pages
                torch.testing.assert_close(flat_mine, flat_full, rtol=1e-5, atol=1e-5)
        # The raw bytes at the advertised address (what the messenger registers) are the same.
        r1 = regions[1]
        off = r1.cache.page_offset(1, pages2[0])
        raw = ctypes.string_at(r1.address + off, r1.cache.page_nbytes)
        assert raw == r1.cache.layer(1)[pages2[0]].contiguous().numpy().tobytes()
        assert two.tp.shard_spec.tp == 2 and two.tp.shard_spec.geometry.num_kv_heads == 2
    finally:
        one.abort("kv")
        two.abort("kv")
        one.step(), two.step()
    assert two.allocator.num_free == two.allocator.num_total


def test_node_regions_and_spec_for_any_tp(llama_pair):
    from pdkv.tp import kv_regions, shard_spec

    one, two = llama_pair
    (r,) = kv_regions(one)
    assert (r.rank, r.address, r.nbytes, r.kv_heads, r.cache) == (0, one.kv.data_ptr(0), one.kv.nbytes, (0, 1), one.kv)
    s1, s2 = shard_spec(one), shard_spec(two)
    assert (s1.tp, s2.tp) == (1, 2)
    assert s1.geometry == s2.geometry  # same model, same pages: only the TP degree differs
    assert s2.geometry.num_kv_heads == 2 and s2.geometry.dtype == "float32"
    assert [x.kv_heads for x in kv_regions(two)] == [tuple(s2.heads_of(r)) for r in range(2)] == [(0,), (1,)]


def test_no_shared_memory_files_left(llama_pair):
    # NOTE: the /dev/shm names are unlinked once every rank has mapped them.
    _, two = llama_pair
    assert len(two.tp._shared) == 2
    assert all(not b.path.exists() for b in two.tp._shared)


def test_layer_hook_fires_after_every_rank_wrote_that_layer(tp, llama_pair):
    # NOTE: the hook runs after o_proj's all-reduce, which rank 1 joins only after its attention
    # wrote its K/V: so when layer i's hook fires in rank 0, every rank's layer-i pages are
    # final, and the messenger may post them (this is what layer-wise transfers rely on).
    _, two = llama_pair
    r1 = two.tp.regions[1]
    snapshots: dict[int, tuple[list[int], torch.Tensor]] = {}

    def hook(layer: int) -> None:
        pages = list(two.requests["hook"].pages)
        snapshots[layer] = pages, r1.cache.layer(layer)[pages].clone()

    two.allocator.evict_all()  # the zeroing below wipes cached pages: no later request may reuse them
    for layer in range(two.kv.num_layers):
        r1.cache.layer(layer).zero_()  # rank 0 writes into rank 1's memory: nothing stale survives
    two.add_request("hook", tp.PROMPTS[2], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
    two.connector.after_layer = hook
    steps = 0
    try:
        while two.has_unfinished():
            snapshots.clear()
            two.step()
            steps += 1
            assert sorted(snapshots) == list(range(two.kv.num_layers))
            for layer, (pages, snap) in snapshots.items():
                assert snap.abs().sum() > 0, f"layer {layer}: rank 1's pages still empty at the hook"
                # Nothing rank 1 wrote later in the step changed what the hook saw.
                torch.testing.assert_close(snap, r1.cache.layer(layer)[pages], rtol=0, atol=0)
    finally:
        two.connector.after_layer = None
    assert steps >= 3
    assert two.allocator.num_free == two.allocator.num_total
