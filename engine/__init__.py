"""pagefleet.engine: one inference replica (paged KV cache, continuous batching).

The public names load lazily: the router imports the engine's pure pieces
(block hashing, tokenization, OpenAI schemas) and must not pay for torch."""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "LLM": "pagefleet.engine.llm",
    "CompletionOutput": "pagefleet.engine.outputs",
    "RequestOutput": "pagefleet.engine.outputs",
    "SamplingParams": "pagefleet.engine.sampling_params",
}
__all__ = list(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'pagefleet.engine' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
