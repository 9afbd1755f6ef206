"""Per-replica record of the prompt blocks the router sent there.

An LRU set of block hashes with a fixed capacity, mirroring the engine's own
prefix cache (which also evicts least recently used blocks), so "the router
sent it these blocks recently" is a good predictor of "it still holds them".
Memory is bounded: about 100 bytes per remembered block.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence


class PrefixIndex:
    def __init__(self, capacity: int) -> None:
        assert capacity > 0
        self.capacity = capacity
        self._lru: OrderedDict[int, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._lru)

    def resize(self, capacity: int) -> None:
        assert capacity > 0
        self.capacity = capacity
        while len(self._lru) > capacity:
            self._lru.popitem(last=False)

    def match(self, hashes: Sequence[int]) -> int:
        """Leading blocks of `hashes` present (hashes chain, so a block only counts
        if every block before it does too)."""
        n = 0
        for h in hashes:
            if h not in self._lru:
                break
            n += 1
        return n

    def add(self, hashes: Sequence[int]) -> None:
        # Insert from the last block back to the first, so the prompt's root blocks are
        # the most recent: when evicting, a chain loses its tail first, as in the engine.
        for h in reversed(hashes):
            self._lru[h] = None
            self._lru.move_to_end(h)
        while len(self._lru) > self.capacity:
            self._lru.popitem(last=False)
