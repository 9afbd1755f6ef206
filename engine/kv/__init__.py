"""Paged KV cache bookkeeping: block pool and per-request block tables."""

from pagefleet.engine.kv.block_pool import BlockPool, FreeBlockQueue, KVBlock
from pagefleet.engine.kv.manager import KVCacheManager

__all__ = ["BlockPool", "FreeBlockQueue", "KVBlock", "KVCacheManager"]
