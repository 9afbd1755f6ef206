"""Fixed-size KV blocks with reference counts and an O(1) free queue.

The pool only does bookkeeping; the KV tensors themselves live in the model
runner, indexed by `block_id`.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(eq=False)
class KVBlock:
    block_id: int
    ref_cnt: int = 0
    # Prefix cache identity, set once the block is full and registered in the
    # pool's hash map; kept after the block is freed so a later request can
    # reuse it, cleared when the block is evicted for new content.
    block_hash: int | None = None
    parent_hash: int | None = None
    token_ids: tuple[int, ...] | None = None
    # Links of the intrusive free list; None while the block is not free.
    prev_free: KVBlock | None = None
    next_free: KVBlock | None = None

    def __repr__(self) -> str:
        return f"KVBlock(id={self.block_id}, ref={self.ref_cnt})"


class FreeBlockQueue:
    """Doubly linked list of free blocks: popleft, append and remove are O(1).

    Removal from the middle matters once freed blocks stay cached (prefix
    caching): a cache hit takes a block back out of the free queue wherever it is.
    """

    def __init__(self, blocks: list[KVBlock]) -> None:
        self._head = KVBlock(-1)  # sentinels: no None checks on the hot path
        self._tail = KVBlock(-1)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self.num_free = 0
        for block in blocks:
            self.append(block)

    def append(self, block: KVBlock) -> None:
        assert block.prev_free is None and block.next_free is None, f"{block} is already free"
        last = self._tail.prev_free
        assert last is not None
        last.next_free = block
        block.prev_free = last
        block.next_free = self._tail
        self._tail.prev_free = block
        self.num_free += 1

    def popleft(self) -> KVBlock:
        block = self._head.next_free
        if block is self._tail or block is None:
            raise ValueError("no free blocks")
        self.remove(block)
        return block

    def remove(self, block: KVBlock) -> None:
        prev, nxt = block.prev_free, block.next_free
        assert prev is not None and nxt is not None, f"{block} is not in the free queue"
        prev.next_free = nxt
        nxt.prev_free = prev
        block.prev_free = block.next_free = None
        self.num_free -= 1

    def __iter__(self):
        block = self._head.next_free
        while block is not self._tail:
            assert block is not None
            yield block
            block = block.next_free


class BlockPool:
    """Blocks, their ref counts, and the prefix cache's hash -> block map.

    A free block may still be cached: it stays in the map until the free queue
    hands it out for new content (lazy eviction, least recently freed first).
    """

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        self.cached: dict[int, KVBlock] = {}

    @property
    def num_free_blocks(self) -> int:
        return self.free_queue.num_free

    @property
    def usage(self) -> float:
        """Fraction of blocks referenced by some request (the `kv_cache_usage_perc` metric)."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    def allocate(self, n: int) -> list[KVBlock]:
        if n > self.num_free_blocks:
            raise ValueError(f"asked for {n} blocks, only {self.num_free_blocks} free")
        out = []
        for _ in range(n):
            block = self.free_queue.popleft()
            assert block.ref_cnt == 0
            if block.block_hash is not None:
                self._evict(block)
            block.ref_cnt = 1
            out.append(block)
        return out

    def touch(self, blocks: list[KVBlock]) -> None:
        """Take a reference on cache hits, pulling free ones out of the free queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_queue.remove(block)
            block.ref_cnt += 1

    # ---- prefix cache ------------------------------------------------------------------

    def lookup(self, block_hash: int, parent_hash: int, token_ids: list[int]) -> KVBlock | None:
        """The cached block with this hash, if its content really matches: a hash
        collision (same hash, other parent or tokens) is a miss, never a wrong hit."""
        block = self.cached.get(block_hash)
        if block is None or block.parent_hash != parent_hash or block.token_ids != tuple(token_ids):
            return None
        return block

    def cache(self, block: KVBlock, block_hash: int, parent_hash: int, token_ids: list[int]) -> None:
        """Register a full block under its hash. If another block already holds the
        same content (two requests computed it at once), the first stays canonical."""
        assert block.ref_cnt > 0 and block.block_hash is None
        if block_hash in self.cached:
            return
        block.block_hash, block.parent_hash, block.token_ids = block_hash, parent_hash, tuple(token_ids)
        self.cached[block_hash] = block

    def _evict(self, block: KVBlock) -> None:
        if self.cached.get(block.block_hash) is block:  # type: ignore[arg-type]
            del self.cached[block.block_hash]  # type: ignore[arg-type]
        block.block_hash = block.parent_hash = block.token_ids = None

    def evict_all(self) -> int:
        """Drop every cached block that no request uses (e.g. after new weights). Returns the count."""
        idle = [b for b in self.cached.values() if b.ref_cnt == 0]
        for block in idle:
            self._evict(block)
        return len(idle)

    def free(self, blocks: list[KVBlock]) -> None:
        """Drop one reference from each block. Callers pass a request's blocks in
        reverse order so that its tail blocks are reused (evicted) before its head."""
        for block in blocks:
            assert block.ref_cnt > 0, f"double free of {block}"
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_queue.append(block)
