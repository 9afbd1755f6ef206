"""Per-request block tables on top of the block pool, with prefix caching.

Blocks are taken on demand as a request's computed tokens grow: no request
reserves its maximum length up front. With prefix caching, a request that
starts (or restarts after preemption) first reuses the longest run of cached
full blocks matching its tokens and computes only the rest; every block it
fills is registered for others to reuse.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from pagefleet.engine.kv.block_pool import BlockPool, KVBlock
from pagefleet.engine.kv.hashing import ROOT_PARENT_HASH

if TYPE_CHECKING:  # request.py imports kv.hashing; avoid the cycle at run time
    from pagefleet.engine.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass
class PrefixCacheStats:
    queries: int = 0  # tokens looked up (each time a request is admitted)
    hits: int = 0  # of those, tokens served from cached blocks


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks)
        self.req_blocks: dict[str, list[KVBlock]] = {}
        self._num_cached_blocks: dict[str, int] = {}  # leading blocks of a request already registered
        self.prefix_stats = PrefixCacheStats()

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def usage(self) -> float:
        return self.pool.usage

    def find_cached_prefix(self, request: Request) -> list[KVBlock]:
        """Longest run of cached blocks matching the request's leading full blocks.

        Stops one token short of the end: the last token is always recomputed,
        because its logits are what the next step samples from."""
        if not self.enable_prefix_caching:
            return []
        hashes = request.update_block_hashes(self.block_size)
        bs = self.block_size
        hits: list[KVBlock] = []
        parent = ROOT_PARENT_HASH
        for i in range(min(len(hashes), (request.num_tokens - 1) // bs)):
            block = self.pool.lookup(hashes[i], parent, request.all_token_ids[i * bs:(i + 1) * bs])
            if block is None:
                break
            hits.append(block)
            parent = hashes[i]
        return hits

    def allocate_slots(self, request: Request, num_tokens_after: int,
                       cached_prefix: list[KVBlock] | None = None) -> bool:
        """Make sure the request owns blocks for `num_tokens_after` tokens of KV,
        starting with `cached_prefix` (from find_cached_prefix) for a request that
        holds no blocks yet. Returns False, changing nothing, if the pool is short."""
        rid = request.request_id
        blocks = self.req_blocks.get(rid, [])
        cached_prefix = cached_prefix or []
        assert not (cached_prefix and blocks), "a cached prefix only starts a block table"
        needed = cdiv(num_tokens_after, self.block_size) - len(blocks) - len(cached_prefix)
        # Cache hits that sit in the free queue leave it, so they count against it too.
        revived = sum(1 for b in cached_prefix if b.ref_cnt == 0)
        if max(needed, 0) + revived > self.pool.num_free_blocks:
            return False
        if cached_prefix:
            self.pool.touch(cached_prefix)
            blocks = list(cached_prefix)
            self._num_cached_blocks[rid] = len(cached_prefix)
        if needed > 0:
            blocks = blocks + self.pool.allocate(needed)
        self.req_blocks[rid] = blocks
        if self.enable_prefix_caching:
            self._cache_full_blocks(request, blocks, num_tokens_after // self.block_size)
        return True

    def _cache_full_blocks(self, request: Request, blocks: list[KVBlock], num_full: int) -> None:
        """Register blocks that will be full once this step's tokens are written.
        Safe before the forward pass runs: within a step every layer writes all
        new K/V before any attention reads, so a same-step hit reads fresh KV."""
        start = self._num_cached_blocks.get(request.request_id, 0)
        if num_full <= start:
            return
        hashes = request.update_block_hashes(self.block_size)
        bs = self.block_size
        for i in range(start, num_full):
            if blocks[i].block_hash is None:
                parent = hashes[i - 1] if i else ROOT_PARENT_HASH
                self.pool.cache(blocks[i], hashes[i], parent, request.all_token_ids[i * bs:(i + 1) * bs])
        self._num_cached_blocks[request.request_id] = num_full

    def record_admission(self, num_tokens: int, num_cached_tokens: int) -> None:
        if self.enable_prefix_caching:
            self.prefix_stats.queries += num_tokens
            self.prefix_stats.hits += num_cached_tokens

    def free(self, request_id: str) -> None:
        """Drop the request's references, tail blocks first: they are the least
        likely to be shared, so they should be evicted before the head."""
        self._num_cached_blocks.pop(request_id, None)
        blocks = self.req_blocks.pop(request_id, None)
        if blocks:
            self.pool.free(list(reversed(blocks)))

    def block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_blocks.get(request_id, ())]

    def reset_prefix_cache(self) -> int:
        return self.pool.evict_all()
