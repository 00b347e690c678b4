"""gpu_check's decode-graphs step: the real engine's decode steps through DecodeGraphs
(pdkv/engine/cuda_graphs.py, ``model.cuda_graphs: true``) on the GPU.

``run_graphs("cuda")``: an engine built from a config with ``cuda_graphs: true`` (so the factory
captures the graphs, CudaGraphCapture) over a random model folder (pdkv.tiny_model):

1. tokens: a float32 model, requests of different lengths joining and leaving (batches padded
   to the captured sizes, an oversize batch, mixed prefill/decode steps): the greedy tokens with
   graphs equal those with ``runner.graphs = None`` (eager) in the same engine;
2. speed: a bf16 model shaped like Qwen2.5-0.5B's layers (24 x hidden 896, 14/2 heads, MLP 4864;
   vocab cut to 32000 to keep the folder small), decode ms per ``engine.step()`` at batch 1 and 8
   with ~300-token contexts: eager, eager + counter, graph, graph + counter (a CudaLayerCounter
   bumped after each layer's o_proj, captured in the graph through cuda_graphs.CounterHook), all
   in the same engine and run; then the counter must equal the bumps issued (one per layer per
   step, none from warm-up or capture).

``run_graphs("cuda", backend="flashinfer")``: the same with FlashInfer's CUDA-graph decode
wrappers (bf16 models with head_dim 128; the tokens are reported, the hidden-state parity of one
step is the check: bf16 greedy over random weights has near-ties a padded GEMM may flip).

``run_graphs("cpu")`` (``gpu_check.py --dry-run``, tests/gpu/test_gpu_check.py): the same flow on
tiny float32 models with the CPU stand-in capture (StandInCapture) and a CpuLayerCounter.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

SIZES = [1, 2, 4, 8]
MAX_LEN = 512
# Qwen2.5-0.5B's layers; its 151936-token vocabulary would make a 1 GB folder for nothing here
QWEN_LAYERS = dict(hidden_size=896, num_layers=24, num_heads=14, num_kv_heads=2, intermediate_size=4864,
                   vocab_size=32000, dtype="bfloat16", std=0.02)
# (step at which it joins, prompt length, tokens): up to 9 requests at once on sizes 1..8
ARRIVALS = [(0, 5, 20), (0, 40, 6), (1, 17, 12), (2, 3, 9), (2, 60, 14), (3, 9, 4), (3, 33, 16),
            (4, 12, 10), (4, 7, 12), (6, 90, 5), (15, 20, 6)]


def _engine(folder: Path, device: str, backend: str):
    import torch

    from pdkv.config import config_from_dict
    from pdkv.engine import LLMEngine
    from pdkv.engine.cuda_graphs import build_decode_graphs

    cuda = device != "cpu"
    cfg = config_from_dict({"model": {"path": str(folder), "device": device, "dtype": "auto", "max_model_len": MAX_LEN,
                                      "attention_backend": backend, "cuda_graphs": cuda,
                                      "cuda_graph_batch_sizes": SIZES},
                            "kv_cache": {"page_size": 16, "num_pages": 512, "prefix_caching": False},
                            "scheduler": {"max_num_seqs": 16}})
    engine = LLMEngine.from_config(cfg)
    if not cuda:  # the config refuses cuda_graphs on a CPU: the stand-in capture, installed by hand
        r = engine.runner
        r.graphs = build_decode_graphs(r.model, r.backend, engine.allocator, MAX_LEN, SIZES, "cpu", stand_in=True)
    assert engine.runner.graphs.capturer.name == ("cuda" if cuda else "stand-in")
    torch.manual_seed(0)
    return engine


def _schedule(engine) -> dict[str, list[int]]:
    import random

    from pdkv.engine import SamplingParams

    rng = random.Random(3)
    prompts = [[rng.randrange(1, 500) for _ in range(n)] for _, n, _ in ARRIVALS]
    out, step = {}, 0
    while step < 80 and (step <= ARRIVALS[-1][0] or engine.has_unfinished()):
        for i, (at, _, m) in enumerate(ARRIVALS):
            if at == step:
                engine.add_request(f"r{i}", prompts[i], SamplingParams(max_tokens=m, temperature=0, ignore_eos=True))
        for o in engine.step():
            out[o.request_id] = o.output_token_ids
        step += 1
    return out


class _Counted:
    """A connector whose layer hook bumps a layer counter, eagerly and inside the graphs."""

    def __new__(cls, counter):
        from pdkv.engine.connector import KVConnector
        from pdkv.engine.cuda_graphs import CounterHook

        c = KVConnector()
        c.hook = CounterHook(counter)
        c.after_layer = c.graph_layer_hook = c.hook
        return c


def _hidden_parity(engine, lengths=(9, 70, 33)) -> float:
    # NOTE: no length a multiple of the page size: the page of a request's next token is taken
    # when that token is scheduled, and this step is built by hand
    """Max |graph - eager| of one decode step's hidden states (3 rows: the size-4 graph, padded),
    on the same KV: the graph step first, then the eager forward over the same batch (it rewrites
    the new tokens' slots with its own K/V)."""
    import torch

    from pdkv.models.attention import AttentionBatch
    from pdkv.engine import SamplingParams
    from pdkv.engine.connector import KVConnector

    for i, n in enumerate(lengths):
        engine.add_request(f"h{i}", [(5 * i + j) % 300 + 1 for j in range(n)],
                           SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    engine.step()  # the prefills: each request now holds one sampled token, not yet in the cache
    reqs = [engine.requests[f"h{i}"] for i in range(len(lengths))]
    ids = [r.output_token_ids[-1] for r in reqs]
    pos = [r.num_tokens - 1 for r in reqs]
    batch = AttentionBatch([1] * len(reqs), [p + 1 for p in pos], [r.pages for r in reqs], len(reqs))
    r = engine.runner
    with torch.inference_mode():
        graph = r.graphs.run(batch, ids, pos, KVConnector()).float()
        dev = r.device
        eager = r.model(torch.tensor(ids, device=dev), torch.tensor(pos, device=dev), r.backend,
                        r.backend.plan(batch), None).float()
    for i in range(len(lengths)):
        engine.abort(f"h{i}")
    engine.step()
    return float((graph - eager).abs().max() / eager.abs().max().clamp_min(1e-6))


def _step_ms(engine, batch: int, steps: int, sync) -> float:
    """ms per engine.step() with ``batch`` requests decoding (~300-token contexts)."""
    from pdkv.engine import SamplingParams

    params = SamplingParams(max_tokens=steps + 8, temperature=0, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"t{i}", [(7 * i + j) % 400 + 1 for j in range(280 + 9 * i)], params)
    for _ in range(4):  # the prefill, then warm decode steps
        engine.step()
    sync()
    t0 = time.perf_counter()
    for _ in range(steps):
        engine.step()
    sync()
    dt = (time.perf_counter() - t0) / steps
    for i in range(batch):
        engine.abort(f"t{i}")
    engine.step()
    return dt * 1e3


def run_graphs(device: str = "cuda", backend: str = "torch", steps: int = 30, speed_model: bool = True) -> tuple[str, dict]:
    """``speed_model``: time the Qwen2.5-0.5B-shaped model on a GPU (False: the small one, tests)."""
    import torch

    from pdkv.gpu.layer_counter import make_layer_counter
    from pdkv.tiny_model import make_tiny_model

    cuda = device != "cpu"
    sync = (lambda: torch.cuda.synchronize(device)) if cuda else (lambda: None)
    data: dict = {"device": device, "attention_backend": backend, "batch_sizes": SIZES}
    head = {"head_dim": 128} if backend == "flashinfer" else {}
    with tempfile.TemporaryDirectory(prefix="pdkv-graphs-") as tmp:
        # 1. tokens, float32 (flashinfer: bfloat16, its only dtypes)
        small = make_tiny_model(Path(tmp) / "small", hidden_size=256 if head else 64, num_heads=2 if head else 4,
                                num_kv_heads=1 if head else 2, dtype="bfloat16" if head else "float32", **head)
        engine = _engine(small, device, backend)
        graphs = engine.runner.graphs
        data["hidden_rel_err"] = err = _hidden_parity(engine)
        tol = 2e-2 if head else 1e-4  # bf16 (flashinfer) / float32
        assert err <= tol, f"one decode step's hidden states: graph vs eager differ by {err:.2e} (relative; tolerance {tol})"
        with_graphs = _schedule(engine)
        engine.runner.graphs = None
        eager = _schedule(engine)
        engine.runner.graphs = graphs
        st = graphs.stats
        assert set(with_graphs) == set(eager) and len(eager) == len(ARRIVALS), "not every request finished"
        differ = [r for r in eager if eager[r] != with_graphs[r]]
        same = sum(a == b for r in eager for a, b in zip(eager[r], with_graphs[r]))
        data.update(tokens_equal=not differ, token_match=same / sum(map(len, eager.values())), num_requests=len(eager),
                    replays=dict(st.replays), widths=dict(st.widths), fallbacks=dict(st.fallbacks),
                    padded_rows=st.padded_rows)
        # NOTE: bf16 greedy over a random model has near-ties that a padded GEMM may flip: there the
        # hidden-state parity above is the check and the token match is reported
        assert head or not differ, (f"graph decode tokens differ from eager for {differ}: "
                                    f"{[(eager[r], with_graphs[r]) for r in differ]}")
        assert st.replays and st.padded_rows and st.fallbacks, f"the schedule did not exercise padding/fallbacks: {st}"
        del engine
        # 2. speed (CPU dry run: the tiny model again, fewer steps)
        big = make_tiny_model(Path(tmp) / "big", **QWEN_LAYERS, **head) if cuda and speed_model else small
        engine = _engine(big, device, backend)
        graphs = engine.runner.graphs
        counter = make_layer_counter(device)
        timings, hooks = {}, []
        try:
            for batch in (1, 8):
                for name, use_graphs, counted in (("eager", False, False), ("eager_counter", False, True),
                                                  ("graph", True, False), ("graph_counter", True, True)):
                    engine.runner.graphs = graphs if use_graphs else None
                    conn = _Counted(counter) if counted else None
                    hooks += [conn.hook] if counted else []
                    engine.set_connector(conn)
                    timings[f"{name}_b{batch}_ms"] = _step_ms(engine, batch, steps if cuda else 4, sync)
            sync()
            data.update(counter_bumps=counter.value(), counter_bumps_issued=sum(h.num_issued for h in hooks),
                        bump_kind=counter.bump_kind.name, graph_replays=dict(graphs.stats.replays))
        finally:
            engine.set_connector(None)
            engine.runner.graphs = None
            del graphs, engine  # the graphs bump the counter's word: gone before it is freed
            if cuda:
                torch.cuda.synchronize(device)
            counter.close()
    assert data["counter_bumps"] == data["counter_bumps_issued"], (
        f"the layer counter reached {data['counter_bumps']}, but {data['counter_bumps_issued']} bumps were "
        "issued (one per layer per step; warm-ups and captures must bump nothing)")
    data.update(timings)
    for b in (1, 8):
        data[f"graph_vs_eager_b{b}"] = timings[f"graph_b{b}_ms"] / timings[f"eager_b{b}_ms"]
        data[f"graph_counter_vs_graph_b{b}"] = timings[f"graph_counter_b{b}_ms"] / timings[f"graph_b{b}_ms"]
    match = "==" if data["tokens_equal"] else f"match {data['token_match']:.0%} of"
    summary = (f"{backend} attention: one step's hidden states graph vs eager within {data['hidden_rel_err']:.1e}; "
               f"greedy tokens with graphs {match} eager for {len(eager)} requests "
               f"(replays {dict(sorted(st.replays.items()))}, {st.padded_rows} padding rows, eager fallbacks "
               f"{dict(st.fallbacks)}); decode ms/step b1: eager {timings['eager_b1_ms']:.2f}, graph "
               f"{timings['graph_b1_ms']:.2f}, graph+counter {timings['graph_counter_b1_ms']:.2f} "
               f"(x{data['graph_counter_vs_graph_b1']:.3f}); b8: eager {timings['eager_b8_ms']:.2f}, graph "
               f"{timings['graph_b8_ms']:.2f}, graph+counter {timings['graph_counter_b8_ms']:.2f} "
               f"(x{data['graph_counter_vs_graph_b8']:.3f}); counter {data['counter_bumps']} ({data['bump_kind']})")
    return summary, data
