"""pagefleet.engine: one inference replica (paged KV cache, continuous batching)."""

from pagefleet.engine.llm import LLM
from pagefleet.engine.outputs import CompletionOutput, RequestOutput
from pagefleet.engine.sampling_params import SamplingParams

__all__ = ["LLM", "CompletionOutput", "RequestOutput", "SamplingParams"]
