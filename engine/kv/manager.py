"""Per-request block tables on top of the block pool.

Blocks are taken on demand as a request's computed tokens grow: no request
reserves its maximum length up front.
"""

from __future__ import annotations

from pagefleet.engine.kv.block_pool import BlockPool, KVBlock


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)
        self.req_blocks: dict[str, list[KVBlock]] = {}

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def usage(self) -> float:
        return self.pool.usage

    def allocate_slots(self, request_id: str, num_tokens_after: int) -> bool:
        """Make sure the request owns enough blocks to hold `num_tokens_after`
        tokens of KV. Returns False (allocating nothing) if the pool is short."""
        blocks = self.req_blocks.setdefault(request_id, [])
        needed = cdiv(num_tokens_after, self.block_size) - len(blocks)
        if needed <= 0:
            return True
        if needed > self.pool.num_free_blocks:
            return False
        blocks.extend(self.pool.allocate(needed))
        return True

    def free(self, request_id: str) -> None:
        blocks = self.req_blocks.pop(request_id, None)
        if blocks:
            self.pool.free(list(reversed(blocks)))

    def block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_blocks.get(request_id, ())]
