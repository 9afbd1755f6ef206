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
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = False
