"""LLMEngine: the Python API over the scheduler, the model runner and the sampler.

One thread owns an engine and calls ``add_request`` / ``abort`` / ``step``; only
``validate_request`` is meant to be called from other threads (it is pure). A step is
``schedule → run → update``: one forward pass in which prefill chunks and decodes share a batch.
"""

from __future__ import annotations

import itertools
import logging
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from pdkv.config import Config, KVCacheConfig, ModelConfig, SchedulerConfig
from pdkv.engine.params import SamplingParams
from pdkv.engine.request import Request, RequestOutput, RequestStatus
from pdkv.engine.runner import ModelRunner
from pdkv.engine.sampler import Sampler
from pdkv.engine.scheduler import Scheduler
from pdkv.errors import InvalidRequest
from pdkv.kv import PageAllocator

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class StepChunk:
    """One request's share of the forward pass about to run (for the step listener)."""

    request_id: str
    start: int  # position of the chunk's first token
    num_tokens: int
    page_ids: tuple[int, ...]  # all of the request's pages
    is_last_chunk: bool  # the chunk reaches the end of the prompt
    prefill_only: bool


def _num_pages(cfg: KVCacheConfig, page_bytes_all_layers: int, device: torch.device, max_useful: int) -> int:
    """cfg.num_pages if set; else what the memory budget holds, capped at ``max_useful`` (every
    running request at full context: more pages could never be used, only zeroed)."""
    if cfg.num_pages is not None:
        if cfg.num_pages < 1:
            raise ValueError(f"kv_cache.num_pages must be >= 1, got {cfg.num_pages}")
        return cfg.num_pages
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        budget = int(free * cfg.memory_fraction)
    else:
        budget = int(cfg.memory_gib * (1 << 30))
    return max(1, min(budget // page_bytes_all_layers, max_useful))


class LLMEngine:
    def __init__(self, model: ModelConfig, kv_cache: KVCacheConfig, scheduler: SchedulerConfig,
                 progress: Callable[[int, int], None] | None = None, kv_buffer=None,
                 num_threads: int | None = None, parallel=None):
        """``kv_buffer``: memory for the KV cache (see pdkv.kv.KVCache), e.g. one the messenger
        registered, or a callable ``f(nbytes) -> buffer`` that makes it once the size is known; ``num_threads``: torch threads on the CPU (default: one per core)."""
        from models import load_model  # noqa: PLC0415 - keeps `import pdkv.engine` light
        from models.loader import read_json, resolve_dtype  # noqa: PLC0415
        from models.attention import get_backend  # noqa: PLC0415
        from pdkv.tokenizer import Tokenizer  # noqa: PLC0415

        path = model.path
        if not path:
            from pdkv.default_model import ensure_default_model  # noqa: PLC0415 - server-owned

            path = str(ensure_default_model())
        device = torch.device(model.device)
        # Cores this process may run on (a container's CPU set), not the host's count.
        num_threads = num_threads or (len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
                                      else os.cpu_count() or 1)
        tp = parallel.tp if parallel is not None else 1  # parallel: a pdkv.config.ParallelConfig
        if tp > 1:
            num_threads = max(1, num_threads // tp)  # the ranks share this host's cores
        if device.type == "cpu":
            torch.set_num_threads(num_threads)
        hf = read_json(Path(path) / "config.json") if Path(path).is_dir() else {}
        # Fail fast, before the weights load: unknown backend, or one that cannot run here.
        get_backend(model.attention_backend).check_available(device, resolve_dtype(model.dtype, hf))
        max_pos = int(hf.get("max_position_embeddings") or 2048)
        if model.max_model_len is not None and not 1 <= model.max_model_len <= max_pos:
            raise ValueError(f"model.max_model_len must be in [1, {max_pos}] (the model's "
                             f"max_position_embeddings), got {model.max_model_len}")
        # With tp > 1, ranks 1.. start now and load their slices while we load ours (pdkv/tp).
        self.tp = None
        if tp > 1:
            if kv_buffer is not None:
                raise ValueError("kv_buffer cannot be combined with parallel.tp > 1: the KV memory of "
                                 "every rank is made by pdkv.tp (register engine.tp.regions instead)")
            from pdkv.tp import TPLeader  # noqa: PLC0415

            self.tp = TPLeader(path, model.dtype, model.device, tp, model.max_model_len or max_pos,
                               num_threads, parallel.timeout_s, parallel.startup_timeout_s)
        self.loaded = load_model(path, model.dtype, str(device), model.max_model_len or max_pos, progress,
                                 tp=self.tp.parallel if self.tp is not None else None)
        arch = self.loaded.arch
        self.model_config, self.kv_config, self.scheduler_config = model, kv_cache, scheduler
        self.config = self.loaded.hf_config
        self.model_name = model.served_name or self.loaded.path.resolve().name
        self.max_model_len = model.max_model_len or arch.max_position_embeddings
        self.tokenizer = Tokenizer(path, arch.eos_token_id)
        self.vocab_size = arch.vocab_size

        from models.kv_layout import kv_layout  # noqa: PLC0415 - K/V heads or an MLA latent, per arch

        layout = kv_layout(arch)
        page_bytes = layout.page_bytes(kv_cache.page_size, self.loaded.dtype) * arch.num_layers
        pages_per_seq = -(-self.max_model_len // kv_cache.page_size)
        num_pages = _num_pages(kv_cache, page_bytes, device, scheduler.max_num_seqs * pages_per_seq)
        if callable(kv_buffer):  # a factory: memory of exactly the cache's size (the messenger registers it)
            kv_buffer = kv_buffer(page_bytes * num_pages)
        if self.tp is not None:  # every rank's cache, all mapped here too (engine.tp.regions)
            self.tp.wait_loaded()
            kv_buffer = self.tp.setup_kv(arch, self.loaded.full_arch, self.loaded.dtype, num_pages,
                                         kv_cache.page_size, kv_cache.layout, model.attention_backend)
        self.kv = layout.make_cache(arch.num_layers, num_pages, kv_cache.page_size, self.loaded.dtype,
                                    kv_cache.layout, device, buffer=kv_buffer)
        self.allocator = PageAllocator(num_pages)
        backend = layout.make_backend(model.attention_backend, self.kv)
        self.runner = ModelRunner(self.loaded.model, backend, device, Sampler(model.seed), num_threads)
        self.runner.followers = self.tp
        self.scheduler = Scheduler(self.allocator, kv_cache.page_size, scheduler.max_num_batched_tokens,
                                   scheduler.chunk_size, scheduler.max_num_seqs)
        self.requests: dict[str, Request] = {}
        # Pages that left scheduling but may not be reused yet (a remote write may still land in
        # them, or a local write may still read them): freed exactly once by release().
        self._held: dict[str, tuple[list[int], bool]] = {}  # rid -> (pages, pinned)
        self._step_listener: Callable[[list[StepChunk]], None] | None = None
        self._pending: list[RequestOutput] = []  # outputs of aborts, returned by the next step
        self._ids = itertools.count()

    @classmethod
    def from_config(cls, cfg: Config, progress: Callable[[int, int], None] | None = None, **kw) -> LLMEngine:
        kw.setdefault("parallel", cfg.parallel)
        return cls(cfg.model, cfg.kv_cache, cfg.scheduler, progress, **kw)

    # ---- requests ------------------------------------------------------------------------------
    def validate_request(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Pure and thread-safe: raises InvalidRequest naming what is wrong."""
        if not isinstance(params, SamplingParams):
            raise InvalidRequest(f"params must be SamplingParams, got {type(params).__name__}")
        params.validate()
        n = len(prompt_token_ids)
        if n == 0:
            raise InvalidRequest("prompt is empty: give at least one token")
        bad = next((t for t in prompt_token_ids if not isinstance(t, int) or not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise InvalidRequest(f"prompt token id {bad!r} is outside the vocabulary [0, {self.vocab_size})")
        if n + params.max_tokens > self.max_model_len:
            raise InvalidRequest(f"prompt ({n} tokens) + max_tokens ({params.max_tokens}) = "
                                 f"{n + params.max_tokens} exceeds the model's context of "
                                 f"{self.max_model_len} tokens")
        need = self.scheduler.pages_for(n + params.max_tokens)
        if need > self.allocator.num_total:
            raise InvalidRequest(f"prompt + max_tokens need {need} KV pages, the cache has only "
                                 f"{self.allocator.num_total}")

    def _make_request(self, request_id: str, prompt, params: SamplingParams) -> Request:
        if request_id in self.requests:
            raise InvalidRequest(f"request id {request_id!r} is already in use")
        if isinstance(prompt, str):
            ids = self.tokenizer.encode(prompt)
        elif isinstance(prompt, (list, tuple)):
            ids = list(prompt)
        else:
            raise InvalidRequest(f"prompt must be a string or a list of token ids, got {type(prompt).__name__}")
        self.validate_request(ids, params)
        # Any integer is a valid seed (negative too): fold it into the generator's 64-bit range.
        gen = torch.Generator().manual_seed(params.seed & (2**64 - 1)) if params.seed is not None else None
        detok = self.tokenizer.detokenizer(ids, params.stop, params.skip_special_tokens)
        return Request(request_id, ids, params, detok, generator=gen)

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams) -> None:
        req = self._make_request(request_id, prompt, params)
        self.requests[request_id] = req
        self.scheduler.add(req)

    def add_remote_request(self, request_id: str, prompt: str | list[int], params: SamplingParams) -> list[int]:
        """Disaggregated decode: reserves pinned pages for the prompt minus its last token and
        parks the request in WAITING_FOR_REMOTE_KV; returns the page ids a remote prefill fills.
        Raises OutOfPages (nothing changed) when the pages are not free; call
        ``remote_kv_ready`` when the writes landed, ``abort`` to give the pages back."""
        req = self._make_request(request_id, prompt, params)
        pages = self.scheduler.add_remote(req)
        self.requests[request_id] = req
        return pages

    def remote_kv_ready(self, request_id: str) -> None:
        """The remote prefill's writes for ``request_id`` have all landed: schedule its decode."""
        req = self.requests.get(request_id)
        if req is None:
            raise InvalidRequest(f"unknown request id {request_id!r}")
        if req.status != RequestStatus.WAITING_FOR_REMOTE_KV:
            raise InvalidRequest(f"request {request_id!r} is {req.status.value}, not waiting for remote KV")
        self.scheduler.remote_ready(req)

    def add_prefill_request(self, request_id: str, prompt_token_ids: list[int]) -> None:
        """Disaggregated prefill: compute the prompt's KV (chunked, batched with others), never
        sample. All its pages are allocated now (OutOfPages: nothing changed, retry later). After
        its last chunk the request leaves with its pages HELD; ``step`` reports it with
        finish_reason "prefilled"; ``release`` frees the pages once its writes are done."""
        if request_id in self.requests or request_id in self._held:
            raise InvalidRequest(f"request id {request_id!r} is already in use")
        ids = list(prompt_token_ids)
        if not ids:
            raise InvalidRequest("prompt is empty: give at least one token")
        bad = next((t for t in ids if not isinstance(t, int) or not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise InvalidRequest(f"prompt token id {bad!r} is outside the vocabulary [0, {self.vocab_size})")
        if len(ids) > self.max_model_len:
            raise InvalidRequest(f"prompt ({len(ids)} tokens) exceeds the model's context of "
                                 f"{self.max_model_len} tokens")
        need = self.scheduler.pages_for(len(ids))
        if need > self.allocator.num_total:
            raise InvalidRequest(f"prompt needs {need} KV pages, this node's cache has only "
                                 f"{self.allocator.num_total}")
        req = Request(request_id, ids, SamplingParams(max_tokens=1), detok=None)
        self.scheduler.add_prefill(req)
        self.requests[request_id] = req

    def abort(self, request_id: str, quarantine: bool = False) -> None:
        """Frees the request's pages exactly once; unknown or finished ids are a no-op. The
        request's final output (finish_reason "abort") comes out of the next ``step``.
        ``quarantine``: the pages are held instead (a write to or from them may still be in
        flight) until ``release(request_id)``."""
        req = self.requests.pop(request_id, None)
        if req is None or req.status.is_done:
            return
        if quarantine:
            pinned = req.status == RequestStatus.WAITING_FOR_REMOTE_KV
            self._held[request_id] = (self.scheduler.detach(req), pinned)
            req.status, req.finish_reason = RequestStatus.ABORTED, "abort"
        else:
            self.scheduler.abort(req)
        if req.detok is not None:
            self._pending.append(self._output(req, []))

    def release(self, request_id: str) -> int:
        """Frees the pages held for ``request_id`` (quarantined or prefilled); returns how many.
        NOTE: call it only when no write to or from those pages can still be in flight."""
        entry = self._held.pop(request_id, None)
        if entry is None:
            return 0
        pages, pinned = entry
        if pinned:
            self.allocator.unpin(pages)
        self.allocator.free(pages)
        return len(pages)

    @property
    def num_held_pages(self) -> int:
        return sum(len(p) for p, _ in self._held.values())

    def set_step_listener(self, fn: Callable[[list[StepChunk]], None] | None) -> None:
        """``fn(chunks)`` runs before each forward pass with the chunks it will compute, so the
        messenger can queue that step's per-layer page writes; None: no call."""
        self._step_listener = fn

    def has_work(self) -> bool:
        """Something a ``step`` can compute or report now (requests parked waiting for remote KV
        are not work: stepping for them would spin)."""
        s = self.scheduler
        return bool(s.running or s.waiting or self._pending)

    def has_unfinished(self) -> bool:
        return bool(self.requests) or bool(self._pending)

    # ---- the step ------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        outputs, self._pending = self._pending, []
        sched = self.scheduler.schedule()
        if not sched.seqs:
            return outputs
        if self._step_listener is not None:
            self._step_listener([StepChunk(s.request.request_id, s.start_pos, len(s.token_ids),
                                           tuple(s.request.pages), s.start_pos + len(s.token_ids) ==
                                           s.request.num_tokens, s.request.prefill_only)
                                 for s in sched.seqs])
        try:
            sampled = self.runner.execute(sched.seqs)
        except Exception:  # a failed forward pass must not take the engine (or pages) with it
            log.exception("forward pass failed; finishing the step's requests with 'error'")
            for s in sched.seqs:
                req = s.request
                self.requests.pop(req.request_id, None)
                if req.prefill_only:  # its earlier chunks' writes may be in flight: hold the pages
                    self._held[req.request_id] = (self.scheduler.detach(req), False)
                    req.status, req.finish_reason = RequestStatus.FINISHED, "error"
                    outputs.append(self._prefill_output(req))
                    continue
                self.scheduler.finish(req, "error")
                outputs.append(self._output(req, []))
            return outputs
        self.scheduler.update_computed(sched)
        for s in sched.seqs:
            req = s.request
            if req.prefill_only and req.num_computed_tokens == req.num_prompt_tokens:
                self.requests.pop(req.request_id, None)
                self._held[req.request_id] = (self.scheduler.detach(req), False)
                req.status, req.finish_reason = RequestStatus.FINISHED, "prefilled"
                outputs.append(self._prefill_output(req))
            elif s.request.request_id in sampled:
                outputs.append(self._append(s.request, sampled[s.request.request_id]))
        return outputs

    def _append(self, req: Request, token: int) -> RequestOutput:
        req.output_token_ids.append(token)
        p = req.params
        req.detok.add(token)
        reason = None
        if (token in self.tokenizer.eos_token_ids and not p.ignore_eos) or token in p.stop_token_ids \
                or req.detok.stopped_on is not None:
            reason = "stop"
        elif len(req.output_token_ids) >= p.max_tokens or req.num_tokens >= self.max_model_len:
            reason = "length"
        if reason is not None:
            self.scheduler.finish(req, reason)
            self.requests.pop(req.request_id, None)
        return self._output(req, [token])

    @staticmethod
    def _prefill_output(req: Request) -> RequestOutput:
        return RequestOutput(req.request_id, [], "", True, req.finish_reason, req.num_prompt_tokens, 0, [], "")

    def _output(self, req: Request, new_ids: list[int]) -> RequestOutput:
        done = req.status.is_done
        return RequestOutput(req.request_id, new_ids, req.detok.flush(done), done, req.finish_reason,
                             req.num_prompt_tokens, len(req.output_token_ids), list(req.output_token_ids),
                             req.detok.text)

    # ---- conveniences ----------------------------------------------------------------------------
    def generate(self, prompts: list, params: SamplingParams | list[SamplingParams]) -> list[RequestOutput]:
        """Runs ``prompts`` (strings or token id lists) to completion; one final output each, in order."""
        plist = params if isinstance(params, list) else [params] * len(prompts)
        ids = [f"gen-{next(self._ids)}" for _ in prompts]
        for rid, prompt, p in zip(ids, prompts, plist):
            self.add_request(rid, prompt, p)
        final: dict[str, RequestOutput] = {}
        while len(final) < len(ids):
            for out in self.step():
                if out.finished and out.request_id in ids:
                    final[out.request_id] = out
        return [self._final(final[r]) for r in ids]

    @staticmethod
    def _final(out: RequestOutput) -> RequestOutput:
        return RequestOutput(out.request_id, list(out.output_token_ids), out.text, True, out.finish_reason,
                             out.num_prompt_tokens, out.num_output_tokens, out.output_token_ids, out.text)

    def stream(self, prompt, params: SamplingParams, request_id: str | None = None) -> Iterator[RequestOutput]:
        """Yields this request's deltas as steps run; closing the iterator early aborts it.
        Outputs of other requests stepped meanwhile are dropped: a server with many requests
        calls ``step`` itself and routes outputs by request id."""
        rid = request_id or f"stream-{next(self._ids)}"
        self.add_request(rid, prompt, params)
        try:
            while True:
                for out in self.step():
                    if out.request_id == rid:
                        yield out
                        if out.finished:
                            return
        finally:
            self.abort(rid)

    def close(self) -> None:
        """Stops the tensor-parallel ranks (if any); idempotent. Also runs at interpreter exit."""
        if self.tp is not None:
            self.tp.close()

    def stats(self) -> dict:
        s = self.scheduler
        return {"num_running": len(s.running), "num_waiting": len(s.waiting),
                "num_waiting_remote_kv": len(s.remote), "num_pages_total": self.allocator.num_total,
                "num_pages_free": self.allocator.num_free, "num_pages_used": self.allocator.num_used,
                "num_preemptions": s.num_preemptions, "page_size": self.kv.page_size,
                "num_pages_held": self.num_held_pages}
