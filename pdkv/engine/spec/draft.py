"""The ``draft`` proposer: a separate small model (same tokenizer and vocabulary as the target)
with its own paged KV cache, drafting greedily k tokens per request per step.

Per request it remembers which tokens its cache holds. Each step it rolls that back to the
longest prefix the request's real tokens still share (drafts the target rejected are dropped,
accepted ones are kept: their KV is already right), feeds the rest of the real tokens in one
chunk (the whole prompt on a request's first step) and then its own drafts one at a time, all
requests batched per round. A request whose draft pages are not free drafts nothing this step
(it decodes plainly): the draft never makes a request wait or fail.

Greedy drafts make ``q`` a point mass, so verification (verify.py) stays exact for sampled
requests too (accept with probability p(d)).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from pdkv.config import MAX_SPEC_TOKENS, ConfigError, SpeculativeConfig
from pdkv.engine.request import Request
from pdkv.engine.spec.paged import PagedProposer
from pdkv.kv import KVCache


@dataclass
class _DraftState:
    tokens: list[int] = field(default_factory=list)  # tokens whose KV is in the draft cache, in order
    pages: list[int] = field(default_factory=list)


def check_same_vocabulary(target_path: Path, target_tok, target_vocab: int, draft_path: Path, draft_tok,
                          draft_vocab: int) -> None:
    """Raises ConfigError naming both models when their vocabularies or tokenizers differ."""
    if draft_vocab != target_vocab:
        raise ConfigError(f"speculative.draft_model.path: the draft model {draft_path} has vocab_size "
                          f"{draft_vocab}, the target {target_path} has {target_vocab}; a draft model "
                          "must share the target's vocabulary")
    if draft_tok._tok.get_vocab() != target_tok._tok.get_vocab():
        raise ConfigError(f"speculative.draft_model.path: the draft model {draft_path} has another "
                          f"tokenizer than the target {target_path} (their token -> id maps differ)")


class DraftProposer(PagedProposer):
    def __init__(self, model, backend, kv: KVCache, device):
        # handoff(req) -> (pages, num_tokens, None): the draft KV of req's first num_tokens tokens
        super().__init__(kv)
        self.model, self.backend, self.device = model, backend, torch.device(device)
        self.states: dict[str, _DraftState] = {}

    @classmethod
    def build(cls, sc: SpeculativeConfig, parts) -> DraftProposer:
        from pdkv.models import load_model  # noqa: PLC0415
        from pdkv.models.attention import get_backend  # noqa: PLC0415
        from pdkv.tokenizer import Tokenizer  # noqa: PLC0415

        path = sc.draft_model.path
        if not path or not Path(path).is_dir():
            raise ConfigError(f"speculative.draft_model.path must be a local Hugging Face model folder for "
                              f"method draft, got {path!r}")
        mc = parts.model_config
        loaded = load_model(path, mc.dtype, mc.device, parts.max_model_len + MAX_SPEC_TOKENS + 1,
                            cpu_kernels=mc.cpu_kernels)
        arch = loaded.arch
        check_same_vocabulary(parts.loaded.path, parts.tokenizer, parts.loaded.arch.vocab_size,
                              Path(path), Tokenizer(path, arch.eos_token_id), arch.vocab_size)
        num_pages = sc.draft_model.num_pages or parts.kv.num_pages
        # NOTE: over one buffer, so a disaggregated node registers the whole cache as one region
        # (pdkv/disagg/spec_handoff.py streams it like the target's)
        page_nbytes = 2 * arch.num_kv_heads * parts.kv.page_size * arch.head_dim * loaded.dtype.itemsize
        buf = torch.zeros(arch.num_layers * num_pages * page_nbytes, dtype=torch.uint8, device=mc.device)
        kv = KVCache(arch.num_layers, num_pages, parts.kv.page_size, arch.num_kv_heads, arch.head_dim,
                     loaded.dtype, parts.kv.layout, torch.device(mc.device), buffer=buf)
        backend = get_backend(mc.attention_backend)(kv, arch.num_heads, arch.num_kv_heads, arch.head_dim,
                                                    arch.head_dim ** -0.5, arch.sliding_window)
        backend.use_cpu_kernel &= mc.cpu_kernels
        return cls(loaded.model, backend, kv, mc.device)

    def _truncate(self, st: _DraftState, n: int) -> None:
        del st.tokens[n:]
        keep = self._pages_for(n)
        if len(st.pages) > keep:
            self.allocator.free(st.pages[keep:])
            del st.pages[keep:]

    def _grow(self, st: _DraftState, n: int) -> bool:
        return self._grow_to(st, len(st.tokens) + n)

    @torch.inference_mode()
    def propose(self, requests: list[Request], num_drafts: list[int]) -> list[list[int]]:
        drafts: list[list[int]] = [[] for _ in requests]
        feed: list[tuple[int, list[int]]] = []  # (index into requests, tokens to feed)
        for i, req in enumerate(requests):
            ctx = req.prompt_token_ids + req.output_token_ids
            st = self.states.get(req.request_id) or self._adopt(req, ctx) \
                or self.states.setdefault(req.request_id, _DraftState())
            common = 0
            limit = min(len(st.tokens), len(ctx) - 1)  # the last token is always fed: its logits draft
            while common < limit and st.tokens[common] == ctx[common]:
                common += 1
            self._truncate(st, common)
            feed.append((i, ctx[common:]))
        for _ in range(max(num_drafts)):
            feed = [(i, toks) for i, toks in feed if self._grow(self.states[requests[i].request_id], len(toks))]
            if not feed:
                break
            nxt = self._forward([(self.states[requests[i].request_id], toks) for i, toks in feed])
            still = []
            for (i, _), t in zip(feed, nxt):
                drafts[i].append(t)
                if len(drafts[i]) < num_drafts[i]:
                    still.append((i, [t]))
            feed = still
        return drafts

    def _adopt(self, req: Request, ctx: list[int]) -> _DraftState | None:
        """The draft KV a prefill node computed for ``req``'s prompt, if any."""
        got = self.handoff(req) if self.handoff is not None else None
        if got is None:
            return None
        pages, num_tokens, _ = got
        st = self.states[req.request_id] = _DraftState(list(ctx[:num_tokens]), list(pages))
        return st

    @torch.inference_mode()
    def run_over(self, items) -> None:
        """items: (page ids, first position, token ids [n]): the draft model's KV for those
        positions goes into the given pages of this cache (a prefill node's hand-off: its draft
        pages are the request's own target page ids). Earlier positions' KV must be there."""
        self._hidden([(_DraftState([-1] * start, list(p)), list(toks)) for p, start, toks in items])

    def _forward(self, items: list[tuple[_DraftState, list[int]]]) -> list[int]:
        """Feeds each state its tokens in one forward pass; returns each one's greedy next token."""
        hidden, rows = self._hidden(items)
        return self.model.compute_logits(hidden[rows]).argmax(-1).tolist()

    def _hidden(self, items: list[tuple[_DraftState, list[int]]]):
        """Feeds each state its tokens in one forward pass: (hidden [T, H], each one's last row)."""
        from pdkv.models.attention import AttentionBatch  # noqa: PLC0415

        order = sorted(range(len(items)), key=lambda j: len(items[j][1]) != 1)  # decodes first
        ids, pos, q_lens, kv_lens, pages, last = [], [], [], [], [], {}
        for j in order:
            st, toks = items[j]
            start = len(st.tokens)
            ids.extend(toks)
            pos.extend(range(start, start + len(toks)))
            q_lens.append(len(toks))
            kv_lens.append(start + len(toks))
            pages.append(st.pages)
            last[j] = len(ids) - 1
            st.tokens.extend(toks)
        batch = AttentionBatch(q_lens, kv_lens, pages, sum(1 for q in q_lens if q == 1))
        meta = self.backend.plan(batch)
        hidden = self.model(torch.tensor(ids, device=self.device), torch.tensor(pos, device=self.device),
                            self.backend, meta)
        return hidden, torch.tensor([last[j] for j in range(len(items))], device=self.device)
