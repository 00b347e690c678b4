"""Paged KV cache memory and its page allocator."""

from pdkv.kv.allocator import PageAllocator
from pdkv.kv.cache import KVCache

__all__ = ["KVCache", "PageAllocator"]
