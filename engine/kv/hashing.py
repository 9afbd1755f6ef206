"""Block hashes: the prefix-cache contract shared by the engine and the router.

A full block's hash covers its parent block's hash, its token ids and (for the
first block only, since every later hash chains it) the extra keys: model name,
adapter, per-request cache salt. The bytes are canonical (fixed-width
little-endian integers, length-prefixed UTF-8 strings) and the hash has a fixed
seed, so any process on any machine computes the same value from the same
tokens: the router predicts which replica holds a prompt's blocks without
asking it.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence

import numpy as np
import xxhash

HASH_SEED = 0x7061676566  # "pagef"; changing it invalidates every router index
ROOT_PARENT_HASH = 0


def _extra_keys_bytes(extra_keys: Sequence[str | int | None]) -> bytes:
    out = bytearray(struct.pack("<I", len(extra_keys)))
    for key in extra_keys:
        if key is None:
            out += b"\x00"
        elif isinstance(key, int):
            out += b"\x01" + struct.pack("<q", key)
        else:
            raw = str(key).encode("utf-8")
            out += b"\x02" + struct.pack("<I", len(raw)) + raw
    return bytes(out)


def hash_block(parent_hash: int, token_ids: Sequence[int], extra_keys: Sequence[str | int | None] = ()) -> int:
    """128-bit hash of one full block given its parent's hash."""
    data = (parent_hash.to_bytes(16, "little")
            + np.asarray(token_ids, dtype="<u4").tobytes()
            + (_extra_keys_bytes(extra_keys) if parent_hash == ROOT_PARENT_HASH else b""))
    return xxhash.xxh3_128_intdigest(data, seed=HASH_SEED)


def block_hashes(token_ids: Sequence[int], block_size: int, extra_keys: Sequence[str | int | None] = (),
                 parent_hash: int = ROOT_PARENT_HASH) -> list[int]:
    """Hashes of every full block of `token_ids` (a trailing partial block has none).

    `extra_keys` is typically (model_name, adapter_name, cache_salt); requests
    with different extra keys never share blocks."""
    hashes = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent_hash = hash_block(parent_hash, token_ids[start:start + block_size], extra_keys)
        hashes.append(parent_hash)
    return hashes
