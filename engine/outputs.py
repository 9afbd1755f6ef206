"""What the engine hands back to callers (offline API and server alike)."""

from __future__ import annotations

from dataclasses import dataclass, field

from pagefleet.engine.sampler import Logprobs


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "abort", None while running
    stop_reason: int | str | None = None  # the stop token id or stop string that matched
    logprobs: list[Logprobs] | None = None


@dataclass
class RequestMetrics:
    arrival_time: float  # time.monotonic() when the request was added
    first_scheduled_time: float | None  # when the scheduler first gave it compute
    first_token_time: float | None  # when its first output token was sampled
    finished_time: float | None

    @property
    def queue_time(self) -> float | None:
        return None if self.first_scheduled_time is None else self.first_scheduled_time - self.arrival_time

    @property
    def time_to_first_token(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = False
    num_cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache
    metrics: RequestMetrics | None = None
