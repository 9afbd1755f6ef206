"""The subset of an HF `config.json` our models need, normalised across versions."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    sliding_window: int | None
    eos_token_ids: tuple[int, ...]
    torch_dtype: str | None

    @classmethod
    def from_hf(cls, hf: dict) -> ModelConfig:
        num_heads = hf["num_attention_heads"]
        model_type = hf.get("model_type", "llama")
        # transformers >= 5 folds rope_theta and scaling into `rope_parameters`;
        # older checkpoints have `rope_theta` + `rope_scaling`.
        rope = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
        rope_theta = float(rope.pop("rope_theta", hf.get("rope_theta", 10000.0)))
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        sliding = hf.get("sliding_window")
        if model_type == "qwen2" and not hf.get("use_sliding_window", False):
            sliding = None  # Qwen2 configs carry a window that is off unless use_sliding_window
        eos = hf.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        return cls(
            architecture=(hf.get("architectures") or [model_type])[0],
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=hf.get("num_key_value_heads") or num_heads,
            head_dim=hf.get("head_dim") or hf["hidden_size"] // num_heads,
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
            rope_theta=rope_theta,
            rope_scaling=None if rope_type == "default" else {**rope, "rope_type": rope_type},
            max_position_embeddings=hf.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", model_type == "qwen2")),
            qkv_bias=bool(hf.get("attention_bias", model_type == "qwen2")),
            sliding_window=sliding,
            eos_token_ids=eos_ids,
            torch_dtype=hf.get("torch_dtype") or hf.get("dtype"),
        )

    @classmethod
    def from_dir(cls, path: str | Path) -> ModelConfig:
        return cls.from_hf(json.loads((Path(path) / "config.json").read_text()))

    def kv_bytes_per_token(self, dtype: torch.dtype) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * dtype.itemsize


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    """Inverse frequencies for RoPE, with the scalings Llama-family checkpoints use."""
    d = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    scaling = cfg.rope_scaling
    if scaling is None:
        return inv_freq
    kind = scaling["rope_type"]
    if kind == "linear":
        return inv_freq / scaling["factor"]
    if kind == "llama3":
        factor = scaling["factor"]
        low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_ctx = scaling["original_max_position_embeddings"]
        low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
        wavelen = 2 * math.pi / inv_freq
        # Long wavelengths are slowed by `factor`, short ones kept, the band between blended.
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_ctx / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        return torch.where(medium, smoothed, scaled)
    raise ValueError(f"rope_scaling type {kind!r} is not supported (supported: default, linear, llama3)")
