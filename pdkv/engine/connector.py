"""The KV connector: the one object through which anything outside the engine takes part in a
request's KV cache (the role vLLM's ``KVConnectorBase_V1`` plays, smaller).

The engine calls it at seven named points, always on the engine thread, in this order for a
request::

    admission(req) -> Admission | Answer   what the engine reserves for req (pages, external
                                    KV, ...), or an Answer instead: NOT_YET (wait) or a refusal
    admit(req) -> Answer            the engine reserved it; reserve the connector's own
                                    per-request resources: RESERVE (done), NOT_YET (the engine
                                    gives the pages back, the request stays at the head of
                                    ``Scheduler.pending`` and is asked again after the next batch
                                    of commands or step) or ``Answer.refuse(...)`` (the request
                                    fails with that error)
    before_forward(batch)           each forward pass, with its layout (ForwardBatch)
    after_layer(layer)              after each layer's attention output projection (o_proj)
    after_forward(batch, hidden)    the final hidden states [num_tokens, hidden_size]
    finished(req)                   the request left the engine (finished, failed or aborted)
    released(request_id)            its held pages were freed (LLMEngine.release): no transfer
                                    can touch the request any more

The scheduler owns the queue of requests waiting for admission (``Scheduler.pending``, in its
policy's order, pdkv/engine/policy.py) and acts on the typed answer: nothing here raises to say
"not now", and a refusal is a value, not an exception through the engine's layers.

Colocated serving uses ``KVConnector`` itself: every point is a no-op and ``after_layer`` is
None, so the model makes no per-layer call at all. Disaggregated serving has two
implementations (pdkv/disagg): the prefill side queues each chunk's complete pages layer by
layer in ``before_forward`` and releases them in ``after_layer``; the decode side asks for the
prompt's KV to come from outside in ``admission`` (pinned pages, WAITING_FOR_REMOTE_KV) and
reserves a hidden-state slot in ``admit``.

Prefix caching (pdkv/kv/prefix_cache.py) uses ``admission``: before calling it the engine
sets ``req.num_cached_tokens`` to the prompt tokens whose KV the local cache already holds (whole
pages, at most all but the last token; a peek, nothing is taken yet). A local request reuses them
by default (and looks again when it is scheduled). A request whose KV comes from outside or that
is prefill-only reuses them only if the connector says so (``reuse_cached=True``), because its
transfer must then be planned around them: the decode side asks the prefill node only for the
tokens after them (``num_external_tokens`` counts from ``req.num_cached_tokens``; the pages to
fill are ``req.pages[req.num_cached_tokens // page_size:]``), the prefill side computes only the
tokens after them (and must still send the reused pages it holds). Pages become visible to the
cache only when complete: computed by a finished forward pass, or for remote KV at
``LLMEngine.remote_kv_ready``.

Speculative decoding (pdkv/engine/spec) is the engine's own and does not go through here, but
for the disaggregated hand-off (pdkv/disagg/spec_handoff.py): the decode side's ``admit``
reserves the proposer's pages (NOT_YET while none are free) and the prefill side's
``after_forward`` runs the proposer over each chunk. An engine feature that needs another
per-request resource reserves it in ``admit`` too, so a request never starts running without
everything it needs; new features use these points rather than add new ones.

NOTE: every method runs on the engine thread, inside ``LLMEngine.admit`` / ``step`` / ``abort`` /
``release``; one that must talk to an event loop posts to it (``loop.call_soon_threadsafe``) and
never waits.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass

from pdkv.engine.request import Request


class Verdict(enum.Enum):
    RESERVE = "reserve"  # reserved: the request is admitted
    NOT_YET = "not yet"  # not free now, nothing kept: the request waits in its place
    REFUSE = "refuse"  # never: the request fails with the answer's reason


@dataclass(frozen=True)
class Answer:
    """A connector's (and the engine's) answer to "may this request be admitted now?"."""

    verdict: Verdict
    reason: str = ""  # a refusal's message, what the client is told
    status: int = 500  # a refusal's HTTP status (503 + retry_after: try again later)
    retry_after: int | None = None
    error: Exception | None = None  # the exception a refusal came from (LLMEngine.add_request raises it)

    @classmethod
    def refuse(cls, reason: str, status: int = 500, retry_after: int | None = None) -> Answer:
        return cls(Verdict.REFUSE, reason, status, retry_after)

    @classmethod
    def refused_by(cls, error: Exception) -> Answer:
        return cls(Verdict.REFUSE, str(error), getattr(error, "status", 500),
                   getattr(error, "retry_after", None), error)


RESERVE = Answer(Verdict.RESERVE)
NOT_YET = Answer(Verdict.NOT_YET)


@dataclass(frozen=True)
class Admission:
    """What the engine reserves for a request before the connector's ``admit`` runs."""

    # Prompt tokens whose KV arrives from outside: their pages are reserved (pinned) now and the
    # request waits in WAITING_FOR_REMOTE_KV until ``LLMEngine.remote_kv_ready``. 0: none.
    num_external_tokens: int = 0
    # Compute the prompt's KV and never sample: every page up front, held after the last chunk
    # until ``LLMEngine.release`` (disaggregated prefill).
    prefill_only: bool = False
    # Take the cached prefix the engine found (req.num_cached_tokens) instead of computing or
    # receiving it. None: yes for a local request, no for external KV or prefill_only (whose
    # transfers must be planned around the reused pages; a connector that plans them says True).
    # With external KV, ``num_external_tokens`` then counts the tokens after the cached prefix.
    reuse_cached: bool | None = None


LOCAL = Admission()


@dataclass(frozen=True)
class BatchEntry:
    """One request's rows in a forward pass: tokens [start, start + num_tokens) of it."""

    request: Request
    start: int  # position of the first token fed (= tokens already in the cache)
    num_tokens: int
    row: int  # its first row in the forward pass's [num_tokens, ...] tensors
    sample: bool  # the row ``row + num_tokens - 1`` is sampled
    # Speculative decoding: the last ``num_draft`` tokens are drafts being verified (their rows
    # are scored too); their KV is rolled back after the step unless they are accepted.
    num_draft: int = 0

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def page_ids(self) -> list[int]:
        """All of the request's pages (they hold positions [0, start + num_tokens))."""
        return self.request.pages

    @property
    def is_last_chunk(self) -> bool:
        """The entry reaches the request's last known token (the end of the prompt, in prefill)."""
        return self.start + self.num_tokens == self.request.num_tokens

    @property
    def prefill_only(self) -> bool:
        return self.request.prefill_only


@dataclass(frozen=True)
class ForwardBatch:
    """The layout of one forward pass, entries in row order (decodes first, see runner.py)."""

    entries: tuple[BatchEntry, ...]
    num_tokens: int


class KVConnector:
    """The no-op connector of colocated serving, and the base of every other one."""

    # ``after_layer(layer_idx)`` after each layer's o_proj; None: the model makes no call (the
    # hot path of colocated serving pays nothing). An instance may set it (fault injection too).
    after_layer: Callable[[int], None] | None = None
    # The same per-layer work in a form CUDA graphs can capture (pdkv/engine/cuda_graphs.py):
    # ``device_bump(layer)`` enqueues device work only, ``replayed(num_layers)`` does the host
    # bookkeeping once per replay (e.g. cuda_graphs.CounterHook). None while ``after_layer`` is
    # set: decode-only steps run eagerly, so the hook runs.
    graph_layer_hook = None

    def admission(self, req: Request) -> Admission | Answer:
        """What the engine must reserve for ``req``; or NOT_YET / ``Answer.refuse(...)`` (the
        client gets its reason) instead of a plan."""
        return LOCAL

    def admit(self, req: Request) -> Answer:
        """``req``'s pages are reserved (``req.pages`` for external KV / prefill-only); reserve
        this connector's own per-request resources. NOT_YET: not now; the engine gives the pages
        back and the request waits in its place until admission is tried again; a refusal fails
        it (the engine gives the pages back too)."""
        return RESERVE

    def before_forward(self, batch: ForwardBatch) -> None:
        """Runs before each forward pass, with the pass's layout."""

    def after_forward(self, batch: ForwardBatch, hidden) -> None:
        """Runs after each forward pass. ``hidden``: [num_tokens, hidden_size], the final hidden
        states after the last norm (what the LM head sees; HF's hidden_states[-1]), rows in
        ``batch`` order; None when the forward pass raised (every request of the batch then
        finishes with "error")."""

    def finished(self, req: Request) -> None:
        """``req`` left the engine: ``req.status`` (FINISHED / ABORTED) and ``req.finish_reason``
        say how. Its pages are freed or, when a transfer may still touch them, held until
        ``LLMEngine.release``."""

    def released(self, request_id: str) -> None:
        """The pages held for ``request_id`` were freed (``LLMEngine.release``): no write to or
        from them can be in flight. What the connector reserved that a transfer could also touch
        (e.g. a proposer's pages a remote prefill writes) may go back now, and not before."""
