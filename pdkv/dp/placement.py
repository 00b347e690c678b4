"""Where a data-parallel group's front puts a new request: on the rank whose prefix cache most
likely holds the prompt's first pages, unless that rank is much busier than the least busy one,
else on the least busy rank that has the pages for it (SGLang's cache-aware DP router, vLLM's DP
load balancing: running + waiting tokens, free KV pages).

Prefix affinity is tracked here, not asked of the ranks: each placed prompt's full pages are
hashed as a chain (page i's key covers pages 0..i, as the ranks' own prefix caches key them), and
the key remembers the rank that got it last (a bounded LRU). The ranks' caches may have evicted
a page since; a wrong guess costs a recomputation, never a wrong token.
"""

from __future__ import annotations

from collections import OrderedDict


class Placer:
    def __init__(self, size: int, page_size: int, balance_tokens: int = 2048, max_keys: int = 1 << 16):
        """``balance_tokens``: how much busier (in outstanding tokens) the affine rank may be than
        the least busy one and still get the request; ``max_keys``: page keys remembered."""
        self.size, self.page_size, self.balance_tokens, self.max_keys = size, page_size, balance_tokens, max_keys
        self._owner: OrderedDict[int, int] = OrderedDict()  # chained page key -> rank
        self.placed_by_affinity = 0
        self.placed_by_load = 0

    def _keys(self, prompt: list[int]) -> list[int]:
        keys, h, P = [], 0, self.page_size
        for i in range(len(prompt) // P):
            h = hash((h, tuple(prompt[i * P:(i + 1) * P])))
            keys.append(h)
        return keys

    def choose(self, prompt: list[int] | None, loads: list[dict]) -> int:
        """loads: per rank, {"tokens", "free_pages", ...} (pdkv/dp/rank.py load_info) plus what
        was placed since; returns the rank."""
        need = -(-len(prompt or ()) // self.page_size)
        fits = [r for r in range(self.size) if loads[r]["free_pages"] >= need] or list(range(self.size))
        least = min(fits, key=lambda r: (loads[r]["tokens"], -loads[r]["free_pages"], r))
        if prompt:
            matched = [0] * self.size
            for k in self._keys(prompt):
                r = self._owner.get(k)
                if r is None:
                    break
                matched[r] += 1
            best = max(fits, key=lambda r: (matched[r], -loads[r]["tokens"]))
            if matched[best] and loads[best]["tokens"] - loads[least]["tokens"] <= self.balance_tokens:
                self.placed_by_affinity += 1
                return best
        self.placed_by_load += 1
        return least

    def placed(self, prompt: list[int] | None, rank: int) -> None:
        for k in self._keys(prompt or []):
            self._owner[k] = rank
            self._owner.move_to_end(k)
        while len(self._owner) > self.max_keys:
            self._owner.popitem(last=False)
