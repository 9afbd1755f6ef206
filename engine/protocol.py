"""OpenAI-compatible request schemas and error bodies (pure; the router reuses them).

Field limits live in the schema (so the OpenAPI document, and fuzzers built on
it, know them); semantic checks that need the model (context length, unknown
model) happen in the server.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from pagefleet.engine.sampling_params import SamplingParams

MAX_N = 16
MAX_LOGPROBS = 20
MAX_STOP = 8

PositiveTokens = Annotated[int, Field(ge=1, le=1_000_000)]
TokenId = Annotated[int, Field(ge=0, le=2**31 - 1)]


def _check_utf8(value: Any, name: str) -> None:
    """JSON can carry lone UTF-16 surrogates ("\\ud800"), which no tokenizer can encode;
    reject them here as the client's error instead of failing deep in the engine."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            raise ValueError(f"{name}: text must be valid Unicode (no lone surrogates)") from None
    elif isinstance(value, list | tuple):
        for v in value:
            _check_utf8(v, name)
    elif isinstance(value, dict):
        for v in value.values():
            _check_utf8(v, name)
    elif isinstance(value, BaseModel):
        _check_utf8(value.__dict__, name)


class StreamOptions(BaseModel):
    include_usage: bool = False


class _SamplingFields(BaseModel):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model_config = ConfigDict(extra="allow")  # unknown OpenAI fields (user, metadata...) are ignored
    TEXT_FIELDS: ClassVar[tuple[str, ...]] = ()  # besides model/stop/cache_salt: text checked for UTF-8

    model: str = Field(min_length=1)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: int | None = Field(default=None, ge=-1, le=1_000_000)
    min_p: float | None = Field(default=None, ge=0, le=1)
    n: int = Field(default=1, ge=1, le=MAX_N)
    stop: str | list[Annotated[str, Field(min_length=1)]] | None = Field(default=None)
    stop_token_ids: list[TokenId] | None = Field(default=None, max_length=64)
    seed: int | None = Field(default=None, ge=-(2**63), le=2**63 - 1)
    presence_penalty: float = Field(default=0.0, ge=-2, le=2)
    frequency_penalty: float = Field(default=0.0, ge=-2, le=2)
    repetition_penalty: float = Field(default=1.0, gt=0, le=10)
    min_tokens: int = Field(default=0, ge=0, le=1_000_000)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    cache_salt: str | None = Field(default=None, min_length=1, max_length=256)
    stream: bool = False
    stream_options: StreamOptions | None = None

    @model_validator(mode="after")
    def _check_stop(self):
        stops = [self.stop] if isinstance(self.stop, str) else (self.stop or [])
        if len(stops) > MAX_STOP:
            raise ValueError(f"stop: at most {MAX_STOP} stop strings")
        if isinstance(self.stop, str) and not self.stop:
            raise ValueError("stop: must be a non-empty string")
        for name in ("model", "stop", "cache_salt", *self.TEXT_FIELDS):
            _check_utf8(getattr(self, name, None), name)
        return self

    def _sampling_params(self, max_tokens: int | None, logprobs: int | None, default_max: int) -> SamplingParams:
        """Raises ValueError naming the field (SamplingParams validates the rest)."""
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return SamplingParams(
            n=self.n,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=self.top_k or 0,
            min_p=self.min_p or 0.0,
            repetition_penalty=self.repetition_penalty,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            seed=self.seed,
            stop=stops,
            stop_token_ids=list(self.stop_token_ids or []),
            max_tokens=default_max if max_tokens is None else max_tokens,
            min_tokens=self.min_tokens,
            ignore_eos=self.ignore_eos,
            logprobs=logprobs,
            skip_special_tokens=self.skip_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
        )


class CompletionRequest(_SamplingFields):
    TEXT_FIELDS = ("prompt",)

    prompt: (Annotated[str, Field(min_length=1)] | Annotated[list[TokenId], Field(min_length=1)]
             | Annotated[list[Annotated[str, Field(min_length=1)]], Field(min_length=1, max_length=64)]
             | Annotated[list[Annotated[list[TokenId], Field(min_length=1)]], Field(min_length=1, max_length=64)])
    max_tokens: PositiveTokens | None = 16
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    echo: Literal[False] = False

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            return [p]  # type: ignore[list-item]
        return list(p)  # type: ignore[arg-type]

    def to_sampling_params(self, default_max: int) -> SamplingParams:
        return self._sampling_params(self.max_tokens, self.logprobs, default_max)


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict[str, Any]] | None = None

    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        parts = []
        for part in self.content:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ValueError("messages: only text content parts are supported")
            parts.append(part["text"])
        return "".join(parts)


class ChatCompletionRequest(_SamplingFields):
    TEXT_FIELDS = ("messages",)

    messages: list[ChatMessage] = Field(min_length=1, max_length=1024)
    max_tokens: PositiveTokens | None = None
    max_completion_tokens: PositiveTokens | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    add_generation_prompt: bool = True

    def to_sampling_params(self, default_max: int) -> SamplingParams:
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs: requires logprobs=true")
        n_logprobs = (self.top_logprobs or 0) if self.logprobs else None
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        return self._sampling_params(max_tokens, n_logprobs, default_max)


def error_body(message: str, err_type: str = "invalid_request_error", param: str | None = None,
               code: str | int | None = None) -> dict:
    """OpenAI's error shape."""
    return {"error": {"message": message, "type": err_type, "param": param, "code": code}}
