"""pagefleet.engine: one inference replica (paged KV cache, continuous batching)."""

from pagefleet.engine.sampling_params import SamplingParams

__all__ = ["SamplingParams"]
