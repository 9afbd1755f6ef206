"""Paged KV cache bookkeeping: block pool, per-request block tables, prefix-cache hashes.

`block_hashes` is public and pure: the router computes the same hashes."""

from pagefleet.engine.kv.block_pool import BlockPool, FreeBlockQueue, KVBlock
from pagefleet.engine.kv.hashing import block_hashes, hash_block
from pagefleet.engine.kv.manager import KVCacheManager

__all__ = ["BlockPool", "FreeBlockQueue", "KVBlock", "KVCacheManager", "block_hashes", "hash_block"]
