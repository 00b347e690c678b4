"""Decode steps under CUDA graphs (pdkv/engine/cuda_graphs.py), on the CPU stand-in capture: the
same DecodeGraphs, static buffers, padding and scratch page as on a GPU, with a "capture" that
records the step function and replays it over those buffers (StandInCapture).

Greedy tokens equal eager decoding while requests join and leave (padding to the captured sizes,
buffer reuse across sizes); padding rows write only the scratch page; mixed, oversize and
verification steps and a non-capturable hook fall back to eager, counted; a capturable counter
hook bumps once per layer per replay and warm-up/capture bump nothing; the torch backend's graph
metadata attends like its eager plan (sliding window included); config refusals."""

from __future__ import annotations

import pytest
import torch

from pdkv.models.attention.base import AttentionBatch
from pdkv.models.attention.torch_backend import TorchAttentionBackend
from pdkv.config import ConfigError, KVCacheConfig, ModelConfig, SchedulerConfig, SpeculativeConfig, load_config
from pdkv.engine import LLMEngine, SamplingParams
from pdkv.engine.connector import KVConnector
from _connectors import RemoteKV, remote_pages
from pdkv.engine.cuda_graphs import HOOK, OVERSIZE, PREFILL, VERIFY, CounterHook, build_decode_graphs
from pdkv.gpu.layer_counter import CpuLayerCounter
from pdkv.kv.cache import KVCache

SIZES = (1, 2, 4)
MAX_LEN = 256


def _engine(path, graphs: bool, speculative=None, num_pages=96):
    e = LLMEngine(ModelConfig(path=str(path), max_model_len=MAX_LEN), KVCacheConfig(page_size=16, num_pages=num_pages),
                  SchedulerConfig(), speculative=speculative)
    if graphs:
        e.runner.graphs = build_decode_graphs(e.runner.model, e.runner.backend, e.allocator, MAX_LEN, SIZES, "cpu",
                                              stand_in=True)
    return e


def _greedy(n):
    return SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)


# (step at which it joins, prompt length, tokens to generate): 1 to 5 requests at once, so steps
# replay sizes 1, 2 and 4 (padded from 3) and a step of 5 is above the largest size; a 150-token
# prompt takes the 16-page table width, the others the 8-page one
ARRIVALS = [(0, 5, 14), (0, 23, 8), (2, 40, 9), (3, 3, 11), (3, 17, 2), (5, 9, 6), (9, 150, 4), (14, 30, 5)]


def _run_schedule(engine) -> dict[str, list[int]]:
    g = torch.Generator().manual_seed(11)
    prompts = {f"r{i}": torch.randint(1, 500, (n,), generator=g).tolist() for i, (_, n, _) in enumerate(ARRIVALS)}
    out, step = {}, 0
    while step < 40 and (step <= max(a for a, _, _ in ARRIVALS) or engine.has_unfinished()):
        for i, (at, _, m) in enumerate(ARRIVALS):
            if at == step:
                engine.add_request(f"r{i}", prompts[f"r{i}"], _greedy(m))
        for o in engine.step():
            out[o.request_id] = o.output_token_ids
        step += 1
    return out


@pytest.fixture(scope="module")
def eager_tokens(tiny_model_dir):
    return _run_schedule(_engine(tiny_model_dir, graphs=False))


def test_graph_decode_tokens_equal_eager_as_requests_join_and_leave(tiny_model_dir, eager_tokens):
    engine = _engine(tiny_model_dir, graphs=True)
    free = engine.allocator.num_free
    got = _run_schedule(engine)
    assert got == eager_tokens and len(got) == len(ARRIVALS)
    st = engine.runner.graphs.stats
    assert set(st.replays) == set(SIZES) and st.padded_rows > 0  # every size replayed, some padded
    assert engine.runner.graphs.widths == (8, 16) and set(st.widths) == {8, 16}
    assert st.fallbacks[PREFILL] > 0 and st.fallbacks[OVERSIZE] > 0
    assert st.num_captures == len(SIZES) * len(engine.runner.graphs.widths)  # captured once, at start
    assert engine.allocator.num_free == free  # every request's pages back; the scratch page stays held
    stats = engine.stats()
    assert stats["cuda_graph_replays"] == sum(st.replays.values()) and stats["cuda_graph_padded_rows"] == st.padded_rows
    assert stats["cuda_graph_fallbacks"] == dict(st.fallbacks)


def _kv_bytes(engine) -> torch.Tensor:
    return torch.stack([engine.kv.layer(i).clone() for i in range(engine.kv.num_layers)], 1)  # [pages, L, ...]


def test_padding_rows_write_only_the_scratch_page(tiny_model_dir):
    """3 decoding requests replay the size-4 graph: its padding row must write the scratch page
    and nothing else; a request waiting for remote KV (pinned pages, not in the batch), the free
    pages and the decoding requests' pages beyond their new slot stay byte for byte."""
    engine = _engine(tiny_model_dir, graphs=True)
    graphs = engine.runner.graphs
    for i, n in enumerate((5, 19, 33)):
        engine.add_request(f"d{i}", list(range(2, 2 + n)), _greedy(4))
    engine.step()  # the prefill (eager)
    engine.set_connector(RemoteKV(ids={"w"}))
    engine.add_request("w", list(range(1, 60)), _greedy(2))
    waiting = remote_pages(engine, "w")
    g = torch.Generator().manual_seed(5)
    for layer in range(engine.kv.num_layers):  # the waiting request's pages and the scratch page: noise
        for p in waiting + [graphs.scratch]:
            engine.kv.layer(layer)[p] = torch.randn(engine.kv.layer(layer)[p].shape, generator=g)
    before = _kv_bytes(engine)
    slots = {}  # page -> slot of the token each decoding request adds this step
    for i in range(3):
        req = engine.requests[f"d{i}"]
        pos = req.num_tokens - 1
        slots[req.pages[pos // 16]] = pos % 16
    engine.step()
    assert graphs.stats.replays == {4: 1} and graphs.stats.padded_rows == 1
    after = _kv_bytes(engine)
    hnd = engine.kv.layout == "HND"
    for p in range(before.shape[0]):
        if p == graphs.scratch:
            assert not torch.equal(before[p], after[p]), "the padding row wrote nothing into the scratch page"
            continue
        b, a = before[p].clone(), after[p].clone()
        if p in slots:  # blank out the one slot this step wrote: the rest must be unchanged
            s = slots[p]
            for t in (a, b):
                if hnd:
                    t[:, :, :, s] = 0
                else:
                    t[:, :, s] = 0
            assert not torch.equal(before[p], after[p])
        assert torch.equal(a, b), f"page {p} changed (waiting request's pages: {waiting})"
    engine.abort("w")


class _Counting(KVConnector):
    """A connector whose per-layer work is a layer counter bump, eager and captured."""

    def __init__(self, capturable: bool):
        self.counter = CpuLayerCounter()
        self.hook = CounterHook(self.counter)
        self.after_layer = self.hook
        self.graph_layer_hook = self.hook if capturable else None


def test_counter_bumps_once_per_layer_per_replay(tiny_model_dir, eager_tokens):
    engine = _engine(tiny_model_dir, graphs=True)
    c = _Counting(capturable=True)
    engine.set_connector(c)
    got = _run_schedule(engine)
    assert got == eager_tokens
    st, L = engine.runner.graphs.stats, engine.kv.num_layers
    forwards = sum(st.replays.values()) + sum(st.fallbacks.values())
    assert st.num_captures == 2 * len(SIZES) * len(engine.runner.graphs.widths)  # recaptured once, with the hook
    assert c.counter.value() == c.hook.num_issued == forwards * L  # warm-ups and captures bumped nothing


def test_non_capturable_hook_runs_eagerly(tiny_model_dir, eager_tokens):
    engine = _engine(tiny_model_dir, graphs=True)
    c = _Counting(capturable=False)
    engine.set_connector(c)
    assert _run_schedule(engine) == eager_tokens
    st = engine.runner.graphs.stats
    assert not st.replays and st.fallbacks[HOOK] > 0
    assert c.counter.value() == sum(st.fallbacks.values()) * engine.kv.num_layers


def test_verification_steps_fall_back(tiny_model_dir):
    spec = SpeculativeConfig(method="ngram", num_tokens=3)
    plain, engine = _engine(tiny_model_dir, graphs=False), _engine(tiny_model_dir, graphs=True, speculative=spec)
    prompt = [7, 8, 9, 10] * 6  # repeats: the ngram proposer drafts
    want = plain.generate([prompt], _greedy(12))[0].output_token_ids
    assert engine.generate([prompt], _greedy(12))[0].output_token_ids == want
    assert engine.runner.graphs.stats.fallbacks[VERIFY] > 0


@pytest.mark.parametrize("window", [None, 8])
def test_graph_metadata_attends_like_the_eager_plan(window):
    """TorchGraphDecode's static table and in-graph mask vs the eager plan, one and three rows."""
    torch.manual_seed(0)
    P, Hq, Hkv, D, num_pages = 4, 4, 2, 8, 64
    kv = KVCache(1, num_pages, P, Hkv, D, torch.float32, "HND", "cpu")
    kv.layer(0).normal_()
    backend = TorchAttentionBackend(kv, Hq, Hkv, D, D ** -0.5, sliding_window=window)
    state = backend.graph_decode(4, 16, (1, 4))
    assert state.widths == (8, 16)
    scratch = num_pages - 1
    for kv_lens, width in (([13], 8), ([5, 30, 17], 8), ([5, 61, 17], 16)):
        pages = [list(range(16 * i, 16 * i + -(-n // P))) for i, n in enumerate(kv_lens)]
        n, bs = len(kv_lens), 1 if len(kv_lens) == 1 else 4
        q, k, v = torch.randn(n, Hq, D), torch.randn(n, Hkv, D), torch.randn(n, Hkv, D)
        eager = backend.forward(0, q, k, v, backend.plan(AttentionBatch([1] * n, kv_lens, pages, n)))
        padded = AttentionBatch([1] * bs, kv_lens + [1] * (bs - n), pages + [[scratch]] * (bs - n), bs)
        state.update(padded, scratch, width)
        wp = torch.tensor([p[(m - 1) // P] for p, m in zip(padded.page_ids, padded.kv_lens)])
        wo = torch.tensor([(m - 1) % P for m in padded.kv_lens])
        pad = lambda x: torch.cat([x, torch.zeros(bs - n, *x.shape[1:])])  # noqa: E731
        got = backend.forward(0, pad(q), pad(k), pad(v), state.meta(bs, width, wp, wo))[:n]
        torch.testing.assert_close(got, eager, rtol=1e-5, atol=1e-5)


def test_config_refusals():
    with pytest.raises(ConfigError, match="model.cuda_graphs must be false with model.device cpu"):
        load_config(None, ["model.cuda_graphs=true"])
    with pytest.raises(ConfigError, match="parallel.tp 2"):
        load_config(None, ["model.cuda_graphs=true", "model.device=cuda", "parallel.tp=2"])
    with pytest.raises(ConfigError, match="increasing list"):
        load_config(None, ["model.cuda_graph_batch_sizes=[4, 2]"])
    with pytest.raises(ConfigError, match="a list of integers"):
        load_config(None, ["model.cuda_graph_batch_sizes=[1, x]"])
    with pytest.raises(ConfigError, match="scheduler.max_num_seqs"):
        load_config(None, ["model.cuda_graphs=true", "model.device=cuda", "model.cuda_graph_batch_sizes=[1, 128]"])
    cfg = load_config(None, ["model.cuda_graphs=true", "model.device=cuda:1", "model.cuda_graph_batch_sizes=[1, 3]"])
    assert cfg.model.cuda_graph_batch_sizes == (1, 3)


def test_real_capture_needs_a_cuda_device(tiny_model_dir):
    engine = _engine(tiny_model_dir, graphs=False)
    free = engine.allocator.num_free
    with pytest.raises(RuntimeError, match="model.cuda_graphs needs a CUDA device"):
        build_decode_graphs(engine.runner.model, engine.runner.backend, engine.allocator, MAX_LEN, SIZES, "cpu")
    assert engine.allocator.num_free == free


def test_a_failed_capture_names_the_option_and_gives_the_scratch_page_back(tiny_model_dir, monkeypatch):
    from pdkv.engine import cuda_graphs

    def fail(self, fn, like):  # fault injection: what a host sync inside the forward does to a capture
        raise RuntimeError("operation not permitted when stream is capturing")

    engine = _engine(tiny_model_dir, graphs=False)
    free = engine.allocator.num_free
    monkeypatch.setattr(cuda_graphs.StandInCapture, "capture", fail)
    with pytest.raises(RuntimeError, match="capturing the decode step failed .*not permitted.*cuda_graphs: false"):
        build_decode_graphs(engine.runner.model, engine.runner.backend, engine.allocator, MAX_LEN, SIZES, "cpu",
                            stand_in=True)
    assert engine.allocator.num_free == free


def test_a_steps_output_is_not_overwritten_by_the_next_replay(tiny_model_dir):
    """What a step returns is kept across the next step (the MTP proposer reads the target's
    hidden states, ``runner.last_forward``, after the step that produced them): returned as a
    view of the graph's static output, the next replay would overwrite it in place."""
    engine = _engine(tiny_model_dir, graphs=True)
    for i, n in enumerate((6, 13)):
        engine.add_request(f"k{i}", list(range(3 + i, 3 + i + n)), _greedy(6))
    engine.step()  # the prefill (eager)
    engine.step()  # decode: a replay of the size-2 graph
    assert engine.runner.graphs.stats.replays == {2: 1}
    kept = engine.runner.last_forward[1]
    snapshot = kept.clone()
    engine.step()  # the next replay, same graph, other tokens
    assert engine.runner.graphs.stats.replays == {2: 2}
    assert not torch.equal(engine.runner.last_forward[1], snapshot)  # the new step's states differ
    assert torch.equal(kept, snapshot), "the previous step's hidden states changed under it"
    while engine.has_unfinished():
        engine.step()
