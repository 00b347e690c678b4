"""What every attention backend gets from the model runner, and the interface it implements.

A step's tokens are flattened: sequence ``i`` owns query tokens ``qo_indptr[i]:qo_indptr[i+1]``.
Its keys after this step are its first ``kv_lens[i]`` tokens, held in pages ``page_ids[i]``.
The runner orders sequences by their number of query tokens: decodes (and 1-token prefill chunks)
first, then short continuations (speculative verifications), then longer chunks, so a backend
can run the leading ones as one batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class AttentionBatch:
    q_lens: list[int]  # query tokens per sequence this step
    kv_lens: list[int]  # tokens in the cache per sequence after this step (includes the new ones)
    page_ids: list[list[int]]  # pages of each sequence, in order
    num_decodes: int  # the first num_decodes sequences have q_len == 1

    @property
    def num_tokens(self) -> int:
        return sum(self.q_lens)


def page_table(page_ids: list[list[int]], device) -> torch.Tensor:
    """[S, max_pages] long, rows padded with page 0 (a valid page, masked out by length)."""
    width = max(len(p) for p in page_ids)
    return torch.tensor([p + [0] * (width - len(p)) for p in page_ids], dtype=torch.long, device=device)


# Steps with at most this many new tokens get their write slots from a Python loop: a dozen
# small tensor ops cost more than the loop there (a verification step's k + 1 tokens).
_LOOP_SLOTS = 64


def write_slots(batch: AttentionBatch, table: torch.Tensor, page_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Where each new token's K/V goes: (page [T], slot in page [T]); for many tokens built
    without a Python loop over them. table: page_table(batch.page_ids)."""
    dev = table.device
    if batch.num_tokens <= _LOOP_SLOTS:
        pages, slots = [], []
        for q_len, kv_len, ids in zip(batch.q_lens, batch.kv_lens, batch.page_ids):
            for i in range(kv_len - q_len, kv_len):
                pages.append(ids[i // page_size])
                slots.append(i % page_size)
        return torch.tensor(pages, dtype=torch.long, device=dev), torch.tensor(slots, dtype=torch.long, device=dev)
    q_lens = torch.tensor(batch.q_lens, device=dev)
    starts = torch.tensor(batch.kv_lens, device=dev) - q_lens  # first new position per sequence
    seq = torch.repeat_interleave(torch.arange(len(batch.q_lens), device=dev), q_lens)  # [T]
    first_tok = torch.cumsum(q_lens, 0) - q_lens  # flat index of each sequence's first token
    pos = starts[seq] + torch.arange(seq.shape[0], device=dev) - first_tok[seq]  # [T]
    return table[seq, pos // page_size], pos % page_size


class GraphDecodeState:
    """A backend's attention metadata for decode steps replayed as CUDA graphs, in buffers that
    never move. A graph is captured per (batch size, page-table width in ``widths``): a step of
    ``bs`` one-token rows whose longest row fills at most ``width`` pages replays the graph of the
    smallest such width. Per step, outside the graph: ``update(batch, fill_page, width)`` writes
    the step's (already padded) ``batch`` into the buffers; inside the captured function:
    ``meta(bs, width, write_pages, write_offsets)`` returns what ``forward`` takes, built only
    from those buffers (and the caller's static write slots [bs] long), so a replay reads the
    step's values. Page-table columns beyond a row's pages hold ``fill_page`` (never read)."""

    widths: tuple[int, ...] = ()

    def update(self, batch: AttentionBatch, fill_page: int, width: int) -> None:
        raise NotImplementedError

    def meta(self, bs: int, width: int, write_pages: torch.Tensor, write_offsets: torch.Tensor) -> object:
        raise NotImplementedError


class AttentionBackend:
    """One object per engine; ``plan`` once per step, ``forward`` once per layer."""

    name = "base"

    @classmethod
    def check_available(cls, device: str, dtype) -> None:
        """Raises BackendUnavailable when this backend cannot run on ``device`` with ``dtype``;
        called before the weights load, so a bad choice fails fast."""

    # Can attend over a latent cache (kv_cache.kv_parts == 1, MLA): see ``forward``.
    supports_latent = False
    # Single-token rows may attend in pdkv's CPU kernel (models/attention/cpu_decode.py; the
    # torch backend); model.cpu_kernels: false turns it off.
    use_cpu_kernel = False

    def __init__(self, kv_cache, num_heads: int, num_kv_heads: int, head_dim: int, scale: float,
                 sliding_window: int | None = None, value_dim: int | None = None):
        self.kv = kv_cache
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.latent = getattr(kv_cache, "kv_parts", 2) == 1
        self.value_dim = value_dim or head_dim
        self.group = num_heads // num_kv_heads
        self.scale = scale
        self.sliding_window = sliding_window

    def fresh_prefill_spans(self, meta) -> list[tuple[int, int]] | None:
        """[(start, end)] per sequence when every sequence of the step is a first prefill chunk
        (its keys are exactly its new tokens), else None; None here: the model never skips
        ``forward`` (MLA's decompressed prefill, models/mla.py, needs ``write`` too)."""
        return None

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor | None, meta) -> None:
        """Writes the step's new k/v into the cache without attending."""
        raise NotImplementedError

    def plan(self, batch: AttentionBatch) -> object:
        """Builds the step's metadata (index tensors, masks) once; returns it."""
        raise NotImplementedError

    def graph_decode(self, max_batch: int, max_pages: int, batch_sizes: tuple[int, ...]) -> "GraphDecodeState":
        """Static decode metadata for CUDA graphs (pdkv/engine/cuda_graphs.py): steps of at most
        ``max_batch`` one-token rows, each over at most ``max_pages`` pages, replayed at the
        ``batch_sizes`` only. Backends that cannot plan into fixed buffers refuse."""
        raise NotImplementedError(f"attention backend {self.name!r} cannot plan decode steps into "
                                  "static buffers (model.cuda_graphs needs attention_backend torch or flashinfer)")

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta) -> torch.Tensor:
        """Writes k/v into the cache, then attends.

        q: [T, num_heads, head_dim]; k, v: [T, num_kv_heads, head_dim] (rope applied).
        Returns [T, num_heads * head_dim].

        Latent cache (MLA, absorbed): k is the latent [T, 1, head_dim], v is None, and each
        cached latent is both the key and, through its first ``value_dim`` entries, the value:
        multi-query attention of all query heads over one shared vector. Returns
        [T, num_heads * value_dim] (still in latent space: the model applies W_UV).
        """
        raise NotImplementedError
