"""A request's state as the scheduler and engine see it."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

import torch

from pagefleet.engine.kv.hashing import ROOT_PARENT_HASH, hash_block
from pagefleet.engine.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"  # waiting again, after its blocks were taken back
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def finished(self) -> bool:
        return self in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH,
                        RequestStatus.FINISHED_ABORTED)


@dataclass(eq=False)
class Request:
    """One sequence. Phase-less: prefill and decode are both "compute the tokens
    in `all_token_ids` past `num_computed_tokens`"; a prefill chunk is just a
    request whose catch-up was cut by the step's token budget."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: tuple[int, ...] = ()
    generator: torch.Generator | None = None
    # Prefix-cache namespace: (model name, adapter, cache salt). Requests with
    # different keys never share KV blocks.
    extra_keys: tuple[str | int | None, ...] = ()
    arrival_time: float = field(default_factory=time.monotonic)

    output_token_ids: list[int] = field(default_factory=list)
    all_token_ids: list[int] = field(init=False)
    num_computed_tokens: int = 0
    status: RequestStatus = RequestStatus.WAITING
    num_preemptions: int = 0
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    num_cached_tokens: int = -1  # prompt tokens served from the prefix cache at first admission
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    block_hashes: list[int] = field(default_factory=list)  # of every full block of all_token_ids

    def __post_init__(self) -> None:
        self.all_token_ids = list(self.prompt_token_ids)

    def update_block_hashes(self, block_size: int) -> list[int]:
        """Extend `block_hashes` to cover every full block (tokens only grow, so
        each block is hashed once)."""
        hashes, tokens = self.block_hashes, self.all_token_ids
        while (len(hashes) + 1) * block_size <= len(tokens):
            start = len(hashes) * block_size
            parent = hashes[-1] if hashes else ROOT_PARENT_HASH
            hashes.append(hash_block(parent, tokens[start:start + block_size], self.extra_keys))
        return hashes

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)
