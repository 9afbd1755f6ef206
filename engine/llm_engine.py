"""Request front of one engine: validation, n > 1 fan-out, text, stop strings.

EngineCore deals in token ids; this layer owns the tokenizer and turns token
updates into RequestOutputs. The offline `LLM` and the server's async front both
drive an LLMEngine.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from pagefleet.engine.config import EngineConfig
from pagefleet.engine.detokenizer import IncrementalDetokenizer
from pagefleet.engine.engine_core import EngineCore, EngineStats
from pagefleet.engine.model_store import resolve_model
from pagefleet.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from pagefleet.engine.request import Request, RequestStatus
from pagefleet.engine.sampling_params import SamplingParams
from pagefleet.engine.tokenization import encode_prompt, load_tokenizer

logger = logging.getLogger(__name__)

def _eos_token_ids(model_dir: Path, hf_config: dict, tokenizer) -> tuple[int, ...]:
    """generation_config.json decides (as in HF generate); config and tokenizer are fallbacks."""
    gen = model_dir / "generation_config.json"
    source = json.loads(gen.read_text()).get("eos_token_id") if gen.is_file() else None
    if source is None:
        source = hf_config.get("eos_token_id")
    if source is None and tokenizer is not None:
        source = tokenizer.eos_token_id
    return tuple(source) if isinstance(source, list) else (() if source is None else (source,))


@dataclass
class _Sequence:
    """Text state of one of a request's n sequences."""
    request: Request
    detok: IncrementalDetokenizer | None
    logprobs: list | None
    num_sent_tokens: int = 0  # streaming: tokens already handed out in deltas


@dataclass
class _RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    stream: bool
    seqs: list[_Sequence] = field(default_factory=list)


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        model_dir = resolve_model(config.model)
        hf_config = json.loads((model_dir / "config.json").read_text())
        self.tokenizer = load_tokenizer(model_dir)
        self.core = EngineCore(config, model_dir, hf_config)
        self.eos_token_ids = _eos_token_ids(model_dir, hf_config, self.tokenizer)
        self.seed = config.seed
        self.model_name = config.served_model_name or str(config.model)
        self._states: dict[str, _RequestState] = {}
        self._seqs: dict[str, tuple[_RequestState, _Sequence]] = {}  # sequence id -> its request

    # ---- requests ----------------------------------------------------------------------

    def encode(self, prompt: str, chat: bool = False) -> list[int]:
        return encode_prompt(self.tokenizer, prompt, chat=chat)

    def validate(self, prompt: str | list[int], params: SamplingParams) -> list[int]:
        """Raise ValueError naming the bad field; return the prompt's token ids."""
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt: must not be empty")
            ids = self.encode(prompt)
        else:
            ids = list(prompt)
            if any(not isinstance(t, int) or isinstance(t, bool) for t in ids):
                raise ValueError("prompt: token ids must be integers")
        if not ids:
            raise ValueError("prompt: must not be empty")
        vocab = self.core.model_config.vocab_size
        if min(ids) < 0 or max(ids) >= vocab:
            raise ValueError(f"prompt: token ids must be in [0, {vocab}), got {min(ids)}..{max(ids)}")
        limit = self.core.max_model_len
        if len(ids) >= limit:
            raise ValueError(f"prompt: {len(ids)} tokens leaves no room to generate within "
                             f"max_model_len={limit}")
        if params.stop and self.tokenizer is None:
            raise ValueError("stop: stop strings need a tokenizer; use stop_token_ids")
        return ids

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                    stream: bool = False, cache_salt: str | None = None) -> None:
        """Queue a request (n sequences).

        With `stream`, step() returns a delta output for the request every step
        it makes progress (new text and token ids since the last one), and text is
        detokenized incrementally. Otherwise only one cumulative output comes, when
        the request finishes; only sequences with stop strings detokenize per
        token, the rest are decoded once at the end (no per-token text work).

        `cache_salt` puts the request in its own prefix-cache namespace: only
        requests with the same salt share KV blocks with it (tenant isolation)."""
        if request_id in self._states:
            raise ValueError(f"request_id: {request_id!r} is already in use")
        if cache_salt is not None and (not isinstance(cache_salt, str) or not cache_salt):
            raise ValueError("cache_salt: must be a non-empty string")
        ids = self.validate(prompt, params)
        extra_keys = (self.model_name, None, cache_salt)
        state = _RequestState(request_id, prompt if isinstance(prompt, str) else None, ids, stream)
        for i in range(params.n):
            seq_id = request_id if params.n == 1 else f"{request_id}#{i}"
            gen = None
            if params.seed is not None:
                gen = torch.Generator(device=self.core.device).manual_seed(params.seed + i)
            req = Request(seq_id, ids, params, self.eos_token_ids, gen, extra_keys)
            detok = None
            if self.tokenizer is not None and (stream or params.stop):
                detok = IncrementalDetokenizer(self.tokenizer, ids, params)
            state.seqs.append(_Sequence(req, detok, [] if params.logprobs is not None else None))
        # Registered only once every sequence was built, so a failure above leaves nothing behind.
        self._states[request_id] = state
        for seq in state.seqs:
            self._seqs[seq.request.request_id] = (state, seq)
            self.core.add_request(seq.request)

    def abort(self, request_id: str) -> None:
        state = self._states.pop(request_id, None)
        if state is None:
            return
        for seq in state.seqs:
            self._seqs.pop(seq.request.request_id, None)
            if not seq.request.status.finished:
                self.core.finish(seq.request, RequestStatus.FINISHED_ABORTED, None)

    def has_unfinished(self) -> bool:
        return bool(self._states)

    # ---- stepping ----------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one engine step. Returns a delta output for every streaming request
        that progressed, and a cumulative output for every other request that finished."""
        touched: dict[str, _RequestState] = {}
        for u in self.core.step():
            state, seq = self._seqs[u.request.request_id]
            if seq.logprobs is not None and u.new_logprobs:
                seq.logprobs.extend(u.new_logprobs)
            if seq.detok is not None:
                stop = seq.detok.update(u.new_token_ids)
                if stop is None and u.request.status.finished:
                    stop = seq.detok.flush()  # held-back bytes may complete a stop string
                if stop is not None:
                    if u.request.status.finished:
                        u.request.status = RequestStatus.FINISHED_STOPPED
                        u.request.stop_reason = stop
                    else:
                        self.core.finish(u.request, RequestStatus.FINISHED_STOPPED, stop)
            touched[state.request_id] = state
        outputs = []
        for rid, state in touched.items():
            finished = all(s.request.status.finished for s in state.seqs)
            if state.stream:
                outputs.append(self._make_delta(state, finished))
            elif finished:
                outputs.append(self._make_output(state))
            if finished:
                del self._states[rid]
                for s in state.seqs:
                    del self._seqs[s.request.request_id]
        return outputs

    def _make_delta(self, state: _RequestState, finished: bool) -> RequestOutput:
        completions = []
        for i, seq in enumerate(state.seqs):
            req = seq.request
            new_ids = req.output_token_ids[seq.num_sent_tokens:]
            new_lps = None if seq.logprobs is None else seq.logprobs[seq.num_sent_tokens:]
            seq.num_sent_tokens = len(req.output_token_ids)
            text = seq.detok.get_delta() if seq.detok is not None else ""
            finish = req.status.value if req.status.finished else None
            completions.append(CompletionOutput(i, text, new_ids, finish, req.stop_reason, new_lps))
        return RequestOutput(state.request_id, state.prompt, state.prompt_token_ids, completions,
                             finished=finished, num_cached_tokens=max(state.seqs[0].request.num_cached_tokens, 0),
                             metrics=self._metrics(state) if finished else None)

    def _make_output(self, state: _RequestState) -> RequestOutput:
        completions = []
        for i, seq in enumerate(state.seqs):
            req = seq.request
            if seq.detok is not None:
                text = seq.detok.output_text
            elif self.tokenizer is not None:
                text = self.tokenizer.decode(req.output_token_ids,
                                             skip_special_tokens=req.sampling_params.skip_special_tokens)
            else:
                text = ""
            finish = req.status.value if req.status.finished else None
            completions.append(CompletionOutput(i, text, list(req.output_token_ids), finish,
                                                req.stop_reason, seq.logprobs))
        return RequestOutput(state.request_id, state.prompt, state.prompt_token_ids, completions,
                             finished=True, num_cached_tokens=max(state.seqs[0].request.num_cached_tokens, 0),
                             metrics=self._metrics(state))

    @staticmethod
    def _metrics(state: _RequestState) -> RequestMetrics:
        def earliest(attr: str) -> float | None:
            return min((t for s in state.seqs if (t := getattr(s.request, attr)) is not None), default=None)

        return RequestMetrics(state.seqs[0].request.arrival_time, earliest("first_scheduled_time"),
                              earliest("first_token_time"), time.monotonic())

    def stats(self) -> EngineStats:
        return self.core.stats()

    def reset_prefix_cache(self) -> int:
        """Forget every cached block no request is using. Returns how many were dropped."""
        return self.core.reset_prefix_cache()
