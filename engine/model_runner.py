"""Turns a scheduled step into one flattened forward pass and samples from it.

Tokens of all scheduled requests are concatenated (decodes first, so the
attention backend can batch them), with their positions and cache slots. The
model runs once; only the positions that produce a token go through the LM head.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from pagefleet.engine.attention import (
    AttentionMetadata,
    DecodeGroup,
    PrefillChunk,
    bucket_by_length,
    causal_mask,
    decode_mask,
)
from pagefleet.engine.kv import KVCacheManager
from pagefleet.engine.models import LlamaForCausalLM
from pagefleet.engine.sampler import Sampler, SamplerOutput, SamplingRow
from pagefleet.engine.scheduler import ScheduledChunk, SchedulerOutput


@dataclass
class StepResult:
    """Sampled tokens, aligned with `sampled_chunks` (the chunks that reached their request's end)."""
    sampled_chunks: list[ScheduledChunk]
    sampler_output: SamplerOutput | None


class ModelRunner:
    def __init__(self, model: LlamaForCausalLM, kv: KVCacheManager, num_blocks: int, block_size: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        cfg = model.cfg
        self.model = model
        self.kv = kv
        self.block_size = block_size
        self.device = device
        self.sliding_window = cfg.sliding_window
        shape = (num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim)
        self.kv_caches = [(torch.zeros(shape, dtype=dtype, device=device),
                           torch.zeros(shape, dtype=dtype, device=device)) for _ in range(cfg.num_layers)]
        self.sampler = Sampler()

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput) -> StepResult:
        # Decodes (one new token) first, shortest context first, so that groups of
        # similar length form contiguous runs the backend attends to in one call each.
        chunks = sorted(sched.chunks, key=lambda c: (c.num_new_tokens != 1, c.request.num_computed_tokens))
        input_ids, positions, meta = self._prepare(chunks)
        hidden = self.model(input_ids, positions, self.kv_caches, meta)

        sampled, last_index, offset = [], [], 0
        for c in chunks:
            offset += c.num_new_tokens
            if c.samples:
                sampled.append(c)
                last_index.append(offset - 1)
        if not sampled:
            return StepResult([], None)
        logits = self.model.compute_logits(hidden[torch.tensor(last_index, device=self.device)])
        rows = [SamplingRow(c.request.sampling_params, c.request.prompt_token_ids,
                            c.request.output_token_ids, c.request.generator, c.request.eos_token_ids)
                for c in sampled]
        return StepResult(sampled, self.sampler(logits, rows))

    def _prepare(self, chunks: list[ScheduledChunk]):
        bs = self.block_size
        ids: list[int] = []
        pos_parts, slot_parts = [], []
        decode_tables: list[list[int]] = []
        decode_lens: list[int] = []
        prefills: list[PrefillChunk] = []
        for c in chunks:
            req, n = c.request, c.num_new_tokens
            start = req.num_computed_tokens
            block_ids = self.kv.block_ids(req.request_id)
            ids.extend(req.all_token_ids[start:start + n])
            pos = np.arange(start, start + n)
            blocks = np.asarray(block_ids, dtype=np.int64)
            pos_parts.append(pos)
            slot_parts.append(blocks[pos // bs] * bs + pos % bs)
            if n == 1:
                decode_tables.append(block_ids)
                decode_lens.append(start + 1)
            else:
                first = len(ids) - n
                needs_mask = start > 0 or self.sliding_window is not None
                mask = causal_mask(start, n, self.sliding_window, self.device) if needs_mask else None
                prefills.append(PrefillChunk(first, first + n, start,
                                             torch.from_numpy(blocks[: -(-(start + n) // bs)]).to(self.device),
                                             mask))
        to = lambda a: torch.from_numpy(np.concatenate(a)).to(self.device)
        meta = AttentionMetadata(slot_mapping=to(slot_parts), num_decode_tokens=len(decode_lens),
                                 prefills=prefills)
        for start, end in bucket_by_length(decode_lens):
            tables = decode_tables[start:end]
            width = max(len(t) for t in tables)
            table = np.zeros((len(tables), width), dtype=np.int64)  # padding is masked out
            for row, t in enumerate(tables):
                table[row, :len(t)] = t
            lens = torch.tensor(decode_lens[start:end], device=self.device)
            meta.decode_groups.append(DecodeGroup(start, end, torch.from_numpy(table).to(self.device),
                                                  decode_mask(lens, width * bs, self.sliding_window)))
        input_ids = torch.tensor(ids, dtype=torch.long, device=self.device)
        return input_ids, to(pos_parts), meta
