"""Paged attention: per-step metadata and the torch reference backend.

The KV cache of one layer is a pair of tensors [num_blocks, block_size,
num_kv_heads, head_dim]. Token t of a request lives in slot
`block_table[t // block_size] * block_size + t % block_size`.

The backend splits a step's flattened batch into decode tokens (one new token
per request, batched into one padded attention call) and prefill chunks (each
its own call, causal within the chunk and over its cached context). Everything
that does not depend on the layer (masks, gather tables) is built once per
step by the model runner, not once per layer.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F


@dataclass
class PrefillChunk:
    start: int  # offset of the chunk's tokens in the flattened batch
    end: int
    context_len: int  # tokens of this request already in the cache before this step
    block_ids: torch.Tensor  # blocks covering context_len + (end - start) tokens
    mask: torch.Tensor | None  # [1, 1, n, context_len + n] bool, None when plain causal suffices


@dataclass
class DecodeGroup:
    """Decodes of similar context length, attended to in one padded call."""
    start: int  # token offsets in the flattened batch (one token per decode)
    end: int
    block_tables: torch.Tensor  # [n, max_blocks] (padding entries point at block 0, masked)
    mask: torch.Tensor  # [n, 1, 1, max_blocks * block_size] bool
    # Gather buffers for K and V, allocated by the first layer and reused by every
    # other: a fresh tens-of-MB tensor per layer costs more in page faults than
    # the copy itself on CPU.
    k_buf: torch.Tensor | None = None
    v_buf: torch.Tensor | None = None


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] cache slot of every token in the step
    num_decode_tokens: int  # tokens [0, num_decode_tokens) are decodes, one per request
    decode_groups: list[DecodeGroup] = field(default_factory=list)
    prefills: list[PrefillChunk] = field(default_factory=list)


def bucket_by_length(lengths: list[int], max_groups: int = 4, min_fill: float = 0.7) -> list[tuple[int, int]]:
    """Split ascending context lengths into contiguous [start, end) groups so that
    padding each group to its own longest wastes little: a group takes shorter
    members while they are at least `min_fill` of its longest; the last allowed
    group takes everything left (each call has a fixed cost)."""
    assert all(a <= b for a, b in zip(lengths, lengths[1:], strict=False)), "lengths must be sorted"
    groups: list[tuple[int, int]] = []
    end = len(lengths)
    while end > 0:
        start = end - 1
        longest = lengths[end - 1]
        while start > 0 and (len(groups) == max_groups - 1 or lengths[start - 1] >= min_fill * longest):
            start -= 1
        groups.append((start, end))
        end = start
    return groups[::-1]


def causal_mask(context_len: int, num_new: int, sliding_window: int | None, device) -> torch.Tensor:
    """Query i (absolute position context_len + i) sees key j iff j <= context_len + i
    and, with a sliding window W, j > context_len + i - W (HF's convention)."""
    q_pos = torch.arange(context_len, context_len + num_new, device=device)[:, None]
    k_pos = torch.arange(context_len + num_new, device=device)[None, :]
    mask = k_pos <= q_pos
    if sliding_window is not None:
        mask &= k_pos > q_pos - sliding_window
    return mask[None, None]


def decode_mask(seq_lens: torch.Tensor, padded_len: int, sliding_window: int | None) -> torch.Tensor:
    k_pos = torch.arange(padded_len, device=seq_lens.device)[None, :]
    mask = k_pos < seq_lens[:, None]
    if sliding_window is not None:
        mask &= k_pos > (seq_lens[:, None] - 1) - sliding_window
    return mask[:, None, None, :]


class TorchAttention:
    """Reference backend: gather blocks, then scaled dot-product attention. Runs on CPU and GPU."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float) -> None:
        assert num_heads % num_kv_heads == 0, "query heads must be a multiple of kv heads"
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.group = num_heads // num_kv_heads
        self.head_dim = head_dim
        self.scale = scale

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 kv_cache: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata) -> torch.Tensor:
        """q: [T, H, D]; k, v: [T, Hkv, D] for this step's tokens. Returns [T, H, D]."""
        k_cache, v_cache = kv_cache
        num_blocks, block_size = k_cache.shape[:2]
        k_cache.view(-1, self.num_kv_heads, self.head_dim).index_copy_(0, meta.slot_mapping, k)
        v_cache.view(-1, self.num_kv_heads, self.head_dim).index_copy_(0, meta.slot_mapping, v)
        out = torch.empty_like(q)

        for g in meta.decode_groups:
            # One padded call per group. The query's G heads that share a kv head
            # become the "query length" dim, so kv is never repeated per head.
            n = g.end - g.start
            qd = q[g.start:g.end].view(n, self.num_kv_heads, self.group, self.head_dim)
            flat = g.block_tables.view(-1)
            if g.k_buf is None:  # the step's first layer sizes the buffers
                g.k_buf = torch.empty((flat.numel(), *k_cache.shape[1:]), dtype=k_cache.dtype, device=k_cache.device)
                g.v_buf = torch.empty_like(g.k_buf)
            torch.index_select(k_cache, 0, flat, out=g.k_buf)
            torch.index_select(v_cache, 0, flat, out=g.v_buf)
            kd = g.k_buf.view(n, -1, self.num_kv_heads, self.head_dim).transpose(1, 2)  # [n, Hkv, L, D]
            vd = g.v_buf.view(n, -1, self.num_kv_heads, self.head_dim).transpose(1, 2)
            od = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=g.mask, scale=self.scale)
            out[g.start:g.end] = od.reshape(n, self.num_heads, self.head_dim)

        for p in meta.prefills:
            n = p.end - p.start
            qp = q[p.start:p.end].transpose(0, 1)[None]  # [1, H, n, D]
            if p.context_len == 0 and p.mask is None:
                # Nothing cached before this chunk: attend to this step's own k/v.
                kp = k[p.start:p.end].transpose(0, 1)[None]
                vp = v[p.start:p.end].transpose(0, 1)[None]
                op = F.scaled_dot_product_attention(qp, kp, vp, is_causal=True, scale=self.scale,
                                                    enable_gqa=self.group > 1)
            else:
                total = p.context_len + n
                kp = k_cache.index_select(0, p.block_ids).flatten(0, 1)[:total].transpose(0, 1)[None]
                vp = v_cache.index_select(0, p.block_ids).flatten(0, 1)[:total].transpose(0, 1)[None]
                op = F.scaled_dot_product_attention(qp, kp, vp, attn_mask=p.mask, scale=self.scale,
                                                    enable_gqa=self.group > 1)
            out[p.start:p.end] = op[0].transpose(0, 1)
        return out
