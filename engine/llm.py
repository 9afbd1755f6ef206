"""Offline batch inference: `LLM(model=...).generate(prompts, params)`."""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

import torch

from pagefleet.engine.config import EngineConfig
from pagefleet.engine.engine_core import EngineStats
from pagefleet.engine.llm_engine import LLMEngine
from pagefleet.engine.outputs import RequestOutput
from pagefleet.engine.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

# A prompt is text, token ids, or a dict {"prompt": str} / {"prompt_token_ids": [...]}
# optionally with "cache_salt" (the request's private prefix-cache namespace).
Prompt = str | list[int] | dict


class LLM:
    def __init__(self, model: str, dtype: str | torch.dtype = "auto", block_size: int = 16,
                 kv_cache_memory: int | str = "2GiB", max_num_seqs: int = 256,
                 max_num_batched_tokens: int = 2048, max_model_len: int | None = None,
                 seed: int = 0, device: str = "auto", num_threads: int | None = None,
                 enable_prefix_caching: bool = True, quantization: str = "none") -> None:
        self._setup(EngineConfig(
            model=str(model), dtype=dtype, device=device, block_size=block_size, kv_cache_memory=kv_cache_memory,
            max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens, max_model_len=max_model_len,
            num_threads=num_threads, seed=seed, enable_prefix_caching=enable_prefix_caching,
            quantization=quantization))

    @classmethod
    def from_config(cls, config: EngineConfig) -> LLM:
        llm = cls.__new__(cls)
        llm._setup(config)
        return llm

    def _setup(self, config: EngineConfig) -> None:
        torch.manual_seed(config.seed)  # unseeded sampling is reproducible per LLM instance
        self.engine = LLMEngine(config)
        self._next_id = 0

    def get_tokenizer(self):
        return self.engine.tokenizer

    def stats(self) -> EngineStats:
        """Engine counters: blocks, preemptions, steps, prefix-cache queries/hits (tokens)."""
        return self.engine.stats()

    def reset_prefix_cache(self) -> int:
        return self.engine.reset_prefix_cache()

    @staticmethod
    def _split_prompt(prompt: Prompt) -> tuple[str | list[int], str | None]:
        if not isinstance(prompt, dict):
            return prompt, None
        unknown = set(prompt) - {"prompt", "prompt_token_ids", "cache_salt"}
        if unknown or ("prompt" in prompt) == ("prompt_token_ids" in prompt):
            raise ValueError("prompt: a dict prompt needs exactly one of 'prompt' or 'prompt_token_ids' "
                             f"(and optionally 'cache_salt'); got keys {sorted(prompt)}")
        return prompt.get("prompt", prompt.get("prompt_token_ids")), prompt.get("cache_salt")

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = False) -> list[RequestOutput]:
        """Generate for every prompt (text or token ids); outputs come back in prompt order.

        All prompts are validated before any is queued: a bad one raises
        ValueError (naming the field and the prompt's index) and leaves the
        engine untouched."""
        if isinstance(prompts, str | dict) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            params = [sampling_params] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(f"sampling_params: got {len(params)} for {len(prompts)} prompts")
        split = []
        for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
            try:
                split.append(self._split_prompt(prompt))
                self.engine.validate(split[-1][0], p)
            except ValueError as e:
                raise ValueError(f"prompts[{i}]: {e}") from None

        ids = []
        for (prompt, salt), p in zip(split, params, strict=True):
            rid = str(self._next_id)
            self._next_id += 1
            self.engine.add_request(rid, prompt, p, cache_salt=salt)
            ids.append(rid)
        return self._run(ids, use_tqdm)

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        done: dict[str, RequestOutput] = {}
        bar = None
        if use_tqdm:
            from tqdm import tqdm

            bar = tqdm(total=len(ids), desc="generate", unit="req")
        start = time.perf_counter()
        while self.engine.has_unfinished():
            for out in self.engine.step():
                done[out.request_id] = out
                if bar is not None:
                    bar.update(1)
        if bar is not None:
            bar.close()
        logger.debug("generated %d requests in %.2fs", len(ids), time.perf_counter() - start)
        return [done[i] for i in ids]
