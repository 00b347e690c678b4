"""Decode steps replayed as CUDA graphs (``model.cuda_graphs``), the way vLLM and SGLang run them.

A decode-only step (every row one new token, no prefill chunk, no draft) of ``n`` rows is padded
up to the smallest captured batch size ``bs >= n`` and replayed (per size, a graph per page-table
width the backend asks for, GraphDecodeState.widths: the torch backend's gather reads every
column, so it captures widths 8, 16, 32, ... pages; FlashInfer reads only the pages in use and
captures one):

    host: copy the step's token ids, positions and write slots into the static inputs, and the
          attention metadata into the backend's static buffers (GraphDecodeState.update)
    graph.replay()   # the whole forward pass; its hidden states land in the static output
    host: hidden = output[:n].clone()   # padding rows' states are dropped, never sampled

Padding rows are token 0 at position 0 over one key, and write their K/V into the **scratch
page**, a page taken from the allocator when the graphs are built and never given to a request,
so they never touch a real request's pages. Real rows' page-table columns beyond their pages
also name the scratch page (masked, never read). Steps with a prefill chunk, a verification, more
rows than the largest size, or a layer hook that cannot be captured run eagerly; each fallback is
counted by reason (``GraphStats``).

Capture (at start, and again if the connector's capturable hook changes): per size, largest
first, the step function runs a few times on a side stream (cuBLAS handles, allocator warm-up)
**without** the layer hook, then is captured with it. So warm-ups never bump the layer counter,
and capture itself runs nothing: after capture the counter is where it was, and each replay
bumps it exactly once per layer, as an eager step does.

The layer hook under graphs: ``KVConnector.after_layer`` runs Python per layer, which a replay
does not. A connector whose per-layer work is only device work offers ``graph_layer_hook``, an
object with ``device_bump(layer)`` (captured: e.g. ``CudaLayerCounter.bump``, a kernel) and
``replayed(num_layers)`` (host bookkeeping, once per replay); ``CounterHook`` is that for a layer
counter. Colocated and decode-role connectors have no hook (graphs run with none); the prefill
role's hook queues writes (and, staged, copies) per layer in Python and has no capturable form,
so its rare decode-shaped steps (one-token chunks) run eagerly.

Two capture implementations behind one interface: ``CudaGraphCapture`` (torch.cuda.CUDAGraph)
and ``StandInCapture``, the CPU stand-in for tests: it records the step function and each replay
runs it again against the same static buffers, so padding, the scratch page, buffer reuse and the
counter's totals are exercised on every CPU run. CUDA is imported only by ``CudaGraphCapture``.
"""

from __future__ import annotations

import bisect
import collections
import logging
from dataclasses import dataclass, field

import torch

from pdkv.models.attention import AttentionBatch

log = logging.getLogger(__name__)

WARMUP_RUNS = 2  # eager runs of each size's step before its capture (vLLM: 1-2)


class CounterHook:
    """A capturable layer hook over a layer counter (pdkv.gpu.layer_counter): eager steps call it
    per layer, graph steps capture ``device_bump`` and call ``replayed`` once per replay.
    ``num_issued`` is the bumps issued so far, the value the counter reaches once they ran."""

    def __init__(self, counter):
        self.counter, self.num_issued = counter, 0

    def __call__(self, layer: int) -> None:  # KVConnector.after_layer (eager)
        self.num_issued += 1
        self.counter.bump()

    def device_bump(self, layer: int) -> None:  # captured: device work only
        self.counter.bump()

    def replayed(self, num_layers: int) -> None:
        self.num_issued += num_layers


class StandInCapture:
    """CPU stand-in for CUDA graph capture (tests): ``capture`` records the function without
    running it (as CUDA capture runs nothing) and ``replay`` runs it again over the same static
    buffers, copying its result into the static output, as a replay overwrites it."""

    name = "stand-in"

    def warm_up(self, fn) -> torch.Tensor:
        out = None
        for _ in range(WARMUP_RUNS):
            out = fn()
        return out

    def capture(self, fn, like: torch.Tensor):
        out = torch.empty_like(like)
        return (lambda: out.copy_(fn())), out


class CudaGraphCapture:
    """torch.cuda.CUDAGraph per graph, all in one memory pool (replays never overlap). Each call
    runs with the model's device current: capture and replay use its current stream."""

    name = "cuda"

    def __init__(self, device):
        self.device = torch.device(device)
        with torch.cuda.device(self.device):
            self.pool = torch.cuda.graph_pool_handle()

    def warm_up(self, fn) -> torch.Tensor:
        with torch.cuda.device(self.device):
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(WARMUP_RUNS):
                    out = fn()
            torch.cuda.current_stream().wait_stream(side)
        return out

    def capture(self, fn, like: torch.Tensor):
        graph = torch.cuda.CUDAGraph()
        # NOTE: thread_local: the messenger's and copy engine's threads may call CUDA meanwhile
        # (event waits, copies on their own streams); only this thread's calls must be capturable
        with torch.cuda.device(self.device), torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
            out = fn()

        def replay():
            with torch.cuda.device(self.device):
                graph.replay()
        return replay, out


@dataclass
class GraphStats:
    replays: collections.Counter = field(default_factory=collections.Counter)  # captured size -> replays
    widths: collections.Counter = field(default_factory=collections.Counter)  # page-table width -> replays
    fallbacks: collections.Counter = field(default_factory=collections.Counter)  # reason -> eager steps
    num_captures: int = 0  # graphs captured (all sizes, every (re)capture)
    padded_rows: int = 0  # padding rows replayed

    def as_dict(self) -> dict:
        """For LLMEngine.stats(): steps replayed / run eagerly (and why), padding, captures."""
        return {"cuda_graph_replays": sum(self.replays.values()), "cuda_graph_eager_steps": sum(self.fallbacks.values()),
                "cuda_graph_fallbacks": dict(self.fallbacks), "cuda_graph_padded_rows": self.padded_rows,
                "cuda_graph_captures": self.num_captures}


# Why a step ran eagerly (GraphStats.fallbacks keys)
PREFILL, VERIFY, OVERSIZE, HOOK = "prefill chunk", "verification", "batch above the largest size", "layer hook"
LONG = "context above max_model_len"


class DecodeGraphs:
    def __init__(self, model, backend, scratch_page: int, batch_sizes, max_pages: int, device, capture):
        """``scratch_page``: a page no request will ever hold (the padding rows' K/V go there);
        ``max_pages``: most pages a request's keys fill (ceil(max_model_len / page_size));
        ``capture``: CudaGraphCapture or StandInCapture."""
        self.model, self.backend, self.scratch, self.max_pages = model, backend, scratch_page, max_pages
        self.sizes = tuple(sorted(batch_sizes))
        self.page_size = backend.kv.page_size
        self.device, self.capturer = torch.device(device), capture
        self.num_layers = len(model.model.layers)
        max_bs = self.sizes[-1]
        # [4, max_bs] long: token ids, positions, write pages, write offsets (one copy per step)
        self._inputs = torch.zeros(4, max_bs, dtype=torch.long, device=self.device)
        self.attn = backend.graph_decode(max_bs, max_pages, self.sizes)
        self.widths = self.attn.widths
        self._graphs: dict[tuple[int, int], tuple] = {}  # (bs, width) -> (replay, static output [bs, H])
        self._hook = None  # the capturable hook the graphs were captured with
        self.stats = GraphStats()

    # ---- which steps -----------------------------------------------------------------------
    def fallback_reason(self, seqs, connector) -> str | None:
        """None when this step replays a graph; else why it runs eagerly (and it is counted)."""
        reason = None
        if any(s.num_draft for s in seqs):
            reason = VERIFY
        elif any(len(s.token_ids) != 1 for s in seqs):
            reason = PREFILL
        elif len(seqs) > self.sizes[-1]:
            reason = OVERSIZE
        elif self._pages(max(s.start_pos + 1 for s in seqs)) > self.widths[-1]:
            reason = LONG
        elif connector.after_layer is not None and connector.graph_layer_hook is None:
            reason = HOOK
        if reason is not None:
            self.stats.fallbacks[reason] += 1
        return reason

    # ---- capture ---------------------------------------------------------------------------
    @torch.inference_mode()
    def capture_all(self, hook=None) -> None:
        """(Re)capture every size with ``hook`` (None, or a graph_layer_hook), largest first."""
        self._graphs.clear()
        self._hook = hook
        for bs in reversed(self.sizes):
            for width in reversed(self.widths):
                self._fill(self._padding_batch(bs), [0] * bs, [0] * bs, width)
                like = self.capturer.warm_up(self._step_fn(bs, width, None))  # no hook: warm-ups never bump
                self._graphs[bs, width] = self.capturer.capture(self._step_fn(bs, width, hook), like)
                self.stats.num_captures += 1

    def _step_fn(self, bs: int, width: int, hook):
        """The captured function: reads only static buffers, ``bs`` and ``width``."""
        ids, pos, wp, wo = (self._inputs[i, :bs] for i in range(4))
        bump = hook.device_bump if hook is not None else None

        def step():
            return self.model(ids, pos, self.backend, self.attn.meta(bs, width, wp, wo), bump)  # [bs, H]
        return step

    def _pages(self, kv_len: int) -> int:
        return -(-kv_len // self.page_size)

    # ---- replay ----------------------------------------------------------------------------
    def run(self, batch: AttentionBatch, ids: list[int], positions: list[int], connector) -> torch.Tensor:
        """One decode step of ``len(ids)`` rows (``fallback_reason`` said None) -> their hidden
        states [n, H] (a copy: the static output is the next replay's)."""
        hook = connector.graph_layer_hook if connector.after_layer is not None else None
        if hook is not self._hook or not self._graphs:
            self.capture_all(hook)
        n = len(ids)
        bs = self.sizes[bisect.bisect_left(self.sizes, n)]
        width = self.widths[bisect.bisect_left(self.widths, self._pages(max(batch.kv_lens)))]
        pad = bs - n
        padded = AttentionBatch([1] * bs, list(batch.kv_lens) + [1] * pad,
                                list(batch.page_ids) + [[self.scratch]] * pad, bs)
        self._fill(padded, list(ids) + [0] * pad, list(positions) + [0] * pad, width)
        replay, out = self._graphs[bs, width]
        replay()
        if hook is not None:
            hook.replayed(self.num_layers)
        self.stats.replays[bs] += 1
        self.stats.widths[width] += 1
        self.stats.padded_rows += pad
        return out[:n].clone()

    def _padding_batch(self, bs: int) -> AttentionBatch:
        return AttentionBatch([1] * bs, [1] * bs, [[self.scratch]] * bs, bs)

    def _fill(self, batch: AttentionBatch, ids: list[int], positions: list[int], width: int) -> None:
        """The step's values into the static buffers (before a replay, and before a capture)."""
        P, pages, offsets = self.page_size, [], []
        for kv_len, row in zip(batch.kv_lens, batch.page_ids):
            pages.append(row[(kv_len - 1) // P])  # the new token's slot: position kv_len - 1
            offsets.append((kv_len - 1) % P)
        host = torch.tensor([ids, positions, pages, offsets], dtype=torch.long)
        cuda = self.device.type == "cuda"
        self._inputs[:, :len(ids)].copy_(host.pin_memory() if cuda else host, non_blocking=cuda)
        self.attn.update(batch, self.scratch, width)


def build_decode_graphs(model, backend, allocator, max_model_len: int, batch_sizes, device,
                        stand_in: bool = False) -> DecodeGraphs:
    """Takes the scratch page from ``allocator`` (held for the engine's life) and captures every
    size. ``stand_in``: the CPU stand-in (tests); else CUDA graphs on ``device``."""
    if stand_in:
        capture = StandInCapture()
    else:
        if torch.device(device).type != "cuda" or not torch.cuda.is_available():
            raise RuntimeError(f"model.cuda_graphs needs a CUDA device torch can use, model.device is {device!r} "
                               f"(torch.cuda.is_available() is {torch.cuda.is_available()})")
        capture = CudaGraphCapture(device)
    scratch = allocator.allocate(1)[0]
    max_pages = -(-max_model_len // backend.kv.page_size)
    try:
        graphs = DecodeGraphs(model, backend, scratch, batch_sizes, max_pages, device, capture)
        graphs.capture_all()
    except Exception as e:
        allocator.free([scratch])
        raise RuntimeError(f"model.cuda_graphs: capturing the decode step failed ({type(e).__name__}: {e}); "
                           "set model.cuda_graphs: false for this model") from e
    log.info("decode graphs (%s): %d captured, batch sizes %s x page-table widths %s; scratch page %d",
             capture.name, graphs.stats.num_captures, ", ".join(map(str, graphs.sizes)),
             ", ".join(map(str, graphs.widths)), scratch)
    return graphs
