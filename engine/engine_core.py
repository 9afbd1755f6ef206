"""The engine's step loop: schedule, run the model once, append tokens, stop.

Knows token ids only; text (detokenization, stop strings) is the LLMEngine's job.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from pagefleet.engine.config import EngineConfig, keep_freed_memory_in_process, resolve_dtype
from pagefleet.engine.kv import KVCacheManager
from pagefleet.engine.model_runner import ModelRunner
from pagefleet.engine.models import model_class_for
from pagefleet.engine.models.config import ModelConfig
from pagefleet.engine.quant import check_quantization, quantize_model, weight_bytes
from pagefleet.engine.request import Request, RequestStatus
from pagefleet.engine.sampler import Logprobs
from pagefleet.engine.scheduler import Scheduler

logger = logging.getLogger(__name__)


@dataclass
class TokenUpdate:
    request: Request
    new_token_ids: list[int]
    new_logprobs: list[Logprobs] | None
    finished: bool


@dataclass
class EngineStats:
    num_blocks: int
    block_size: int
    max_model_len: int
    num_free_blocks: int
    num_running: int
    num_waiting: int
    peak_num_running: int
    num_preemptions: int
    num_steps: int
    prefix_cache_queries: int  # prompt tokens looked up in the prefix cache
    prefix_cache_hits: int  # of those, tokens whose KV was reused
    num_computed_tokens: int  # tokens that went through the model (prefill + decode)
    num_prompt_tokens_computed: int  # of those, prompt positions (what prefix caching saves)


class EngineCore:
    def __init__(self, config: EngineConfig, model_dir: Path, hf_config: dict) -> None:
        self.config = config
        self.device = config.torch_device()
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        if self.device.type == "cpu":
            keep_freed_memory_in_process()
        self.model_config = cfg = ModelConfig.from_hf(hf_config)
        self.dtype = resolve_dtype(config.dtype, self.device, cfg.torch_dtype)

        with torch.device(self.device):
            model = model_class_for(hf_config)(cfg, self.dtype, self.device)
        check_quantization(config.quantization, self.device)
        model.load_weights(model_dir)
        self.model = model.to(self.dtype).eval()
        if quantize_model(self.model, config.quantization):
            logger.info("quantized the decoder's linear layers to %s: weights now %.0f MiB",
                        config.quantization, weight_bytes(self.model) / 2**20)

        bytes_per_block = cfg.kv_bytes_per_token(self.dtype) * config.block_size
        self.num_blocks = config.kv_cache_bytes // bytes_per_block
        if self.num_blocks < 1:
            raise ValueError(f"kv_cache_memory: {config.kv_cache_bytes} bytes is less than one block "
                             f"({bytes_per_block} bytes at block_size={config.block_size})")
        capacity = self.num_blocks * config.block_size
        if config.max_model_len is not None and config.max_model_len > cfg.max_position_embeddings:
            raise ValueError(f"max_model_len ({config.max_model_len}) exceeds the model's context length "
                             f"({cfg.max_position_embeddings})")
        # A request must fit in the whole cache on its own, or it could never finish.
        self.max_model_len = min(config.max_model_len or cfg.max_position_embeddings, capacity)
        if config.max_model_len and config.max_model_len > capacity:
            raise ValueError(f"max_model_len ({config.max_model_len}) needs more KV cache than "
                             f"kv_cache_memory allows ({capacity} tokens); raise kv_cache_memory")

        self.kv = KVCacheManager(self.num_blocks, config.block_size, config.enable_prefix_caching)
        self.num_computed_tokens = 0
        self.num_prompt_tokens_computed = 0
        self.scheduler = Scheduler(self.kv, config.max_num_seqs, config.max_num_batched_tokens,
                                   self.max_model_len)
        self.runner = ModelRunner(self.model, self.kv, self.num_blocks, config.block_size, self.dtype,
                                  self.device)
        logger.info("engine ready: %s, dtype=%s, device=%s, %d KV blocks x %d tokens (%.1f MiB), "
                    "max_model_len=%d", cfg.architecture, self.dtype, self.device, self.num_blocks,
                    config.block_size, self.num_blocks * bytes_per_block / 2**20, self.max_model_len)

    def add_request(self, request: Request) -> None:
        self.scheduler.add_request(request)

    def abort(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            self.scheduler.abort(rid)

    def finish(self, request: Request, status: RequestStatus, stop_reason: int | str | None) -> None:
        request.stop_reason = stop_reason
        self.scheduler.finish(request, status)

    def has_unfinished(self) -> bool:
        return self.scheduler.num_unfinished > 0

    def step(self) -> list[TokenUpdate]:
        sched = self.scheduler.schedule()
        if sched.is_empty:
            return []
        for c in sched.chunks:
            start, end = c.request.num_computed_tokens, c.request.num_computed_tokens + c.num_new_tokens
            self.num_prompt_tokens_computed += max(0, min(end, c.request.num_prompt_tokens) - start)
        result = self.runner.execute(sched)
        self.scheduler.update_after_step(sched)
        self.num_computed_tokens += sched.num_batched_tokens
        if result.sampler_output is None:
            return []
        updates = []
        out = result.sampler_output
        now = time.monotonic()
        for chunk, token, lp in zip(result.sampled_chunks, out.token_ids, out.logprobs, strict=True):
            req = chunk.request
            if req.first_token_time is None:
                req.first_token_time = now
            req.append_output_token(token)
            status, reason = self._check_stop(req, token)
            if status is not None:
                self.finish(req, status, reason)
            updates.append(TokenUpdate(req, [token], None if lp is None else [lp], status is not None))
        return updates

    def _check_stop(self, req: Request, token: int) -> tuple[RequestStatus | None, int | None]:
        p = req.sampling_params
        if req.num_output_tokens >= p.min_tokens:
            if not p.ignore_eos and token in req.eos_token_ids:
                return RequestStatus.FINISHED_STOPPED, None
            if token in p.stop_token_ids:
                return RequestStatus.FINISHED_STOPPED, token
        if req.num_output_tokens >= p.max_tokens or req.num_tokens >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH, None
        return None, None

    def stats(self) -> EngineStats:
        s = self.scheduler
        return EngineStats(self.num_blocks, self.config.block_size, self.max_model_len,
                           self.kv.num_free_blocks, len(s.running), len(s.waiting),
                           s.stats.peak_num_running, s.stats.num_preemptions, s.stats.num_steps,
                           self.kv.prefix_stats.queries, self.kv.prefix_stats.hits, self.num_computed_tokens,
                           self.num_prompt_tokens_computed)

    def reset_prefix_cache(self) -> int:
        return self.kv.reset_prefix_cache()
