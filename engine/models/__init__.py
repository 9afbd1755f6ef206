"""Model implementations, chosen by the HF config's `architectures` / `model_type`."""

from __future__ import annotations

from pagefleet.engine.models.llama import LlamaForCausalLM

# Llama, Mistral and Qwen2 share one decoder shape; the differences (qkv bias,
# tied embeddings, sliding window, RoPE scaling) are read from the config.
_REGISTRY = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
}
_MODEL_TYPES = {"llama": LlamaForCausalLM, "mistral": LlamaForCausalLM, "qwen2": LlamaForCausalLM}


def model_class_for(hf_config: dict) -> type[LlamaForCausalLM]:
    for arch in hf_config.get("architectures") or []:
        if arch in _REGISTRY:
            return _REGISTRY[arch]
    if hf_config.get("model_type") in _MODEL_TYPES:
        return _MODEL_TYPES[hf_config["model_type"]]
    raise ValueError(
        f"model: unsupported architecture {hf_config.get('architectures')} "
        f"(model_type={hf_config.get('model_type')!r}); supported: {sorted(_REGISTRY)}"
    )


__all__ = ["LlamaForCausalLM", "model_class_for"]
