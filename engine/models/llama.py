"""Llama-family decoder (Llama 2/3, Mistral, Qwen2): our own implementation.

Differences between the three come from the config: GQA/MQA head counts, qkv
bias (Qwen2), tied embeddings, sliding window (Mistral), RoPE scaling (Llama 3).
Projections are fused (qkv, gate+up) at load time: fewer, larger matmuls.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import safe_open
from torch import nn

from pagefleet.engine.attention import AttentionMetadata, TorchAttention
from pagefleet.engine.models.config import ModelConfig, rope_inv_freq


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in fp32 and cast back before scaling, as HF does: this keeps
        # low-precision runs numerically aligned with the reference.
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


class Rotary:
    """Precomputed cos/sin for every position; looked up by position each step."""

    def __init__(self, cfg: ModelConfig, max_positions: int, dtype: torch.dtype, device) -> None:
        inv_freq = rope_inv_freq(cfg)
        t = torch.arange(max_positions, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos = emb.cos().to(dtype=dtype, device=device)
        self.sin = emb.sin().to(dtype=dtype, device=device)

    def __call__(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        cos = self.cos[positions][:, None, :]  # [T, 1, D]
        sin = self.sin[positions][:, None, :]
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        h, d = cfg.hidden_size, cfg.head_dim
        self.q_size = cfg.num_heads * d
        self.kv_size = cfg.num_kv_heads * d
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, d
        self.input_layernorm = RMSNorm(h, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(h, cfg.rms_norm_eps)
        self.qkv_proj = nn.Linear(h, self.q_size + 2 * self.kv_size, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(self.q_size, h, bias=False)
        self.gate_up_proj = nn.Linear(h, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, h, bias=False)
        self.attn = TorchAttention(cfg.num_heads, cfg.num_kv_heads, d, scale=d**-0.5)

    def forward(self, x, positions, rotary: Rotary, kv_cache, meta: AttentionMetadata):
        t = x.shape[0]
        qkv = self.qkv_proj(self.input_layernorm(x))
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(t, self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        q, k = rotary(positions, q, k)
        attn = self.attn(q, k, v.contiguous(), kv_cache, meta)
        x = x + self.o_proj(attn.view(t, self.q_size))
        gate, up = self.gate_up_proj(self.post_attention_layernorm(x)).chunk(2, dim=-1)
        return x + self.down_proj(F.silu(gate) * up)


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.rotary = Rotary(cfg, cfg.max_position_embeddings, dtype, device)
        for p in self.parameters():
            p.requires_grad_(False)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]], meta: AttentionMetadata) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            x = layer(x, positions, self.rotary, kv_cache, meta)
        return self.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    # ---- loading -------------------------------------------------------------------------

    # HF projection name -> (our fused projection, shard index within it)
    _FUSED = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
              "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}

    def load_weights(self, model_dir: str | Path) -> None:
        """Copy HF safetensors weights in, fusing q/k/v and gate/up as they arrive."""
        files = sorted(Path(model_dir).glob("*.safetensors"))
        if not files:
            raise ValueError(f"model: no *.safetensors files in {model_dir}")
        params = dict(self.named_parameters())
        loaded: set[str] = set()  # our parameter names, or "name#shard" for fused parts
        for f in files:
            with safe_open(str(f), framework="pt") as st:
                for name in st.keys():
                    self._load_one(name, st.get_tensor(name), params, loaded)
        if self.cfg.tie_word_embeddings or "lm_head.weight" not in loaded:
            self.lm_head.weight = self.embed_tokens.weight
            loaded.add("lm_head.weight")
        expected = set()
        for pname in params:
            sub = pname.split(".")[-2]
            shards = {"qkv_proj": 3, "gate_up_proj": 2}.get(sub)
            expected |= {f"{pname}#{i}" for i in range(shards)} if shards else {pname}
        missing = expected - loaded
        if missing:
            raise ValueError(f"model: checkpoint in {model_dir} lacks weights: {sorted(missing)[:8]}")

    def _load_one(self, name: str, tensor: torch.Tensor, params: dict[str, nn.Parameter],
                  loaded: set[str]) -> None:
        parts = name.removeprefix("model.").split(".")
        if "rotary_emb" in parts:
            return
        shard = None
        if parts[0] == "layers":
            sub, kind = parts[-2], parts[-1]  # e.g. layers.3.self_attn.q_proj.weight
            if sub in self._FUSED:
                sub, shard = self._FUSED[sub]
            ours = f"layers.{parts[1]}.{sub}.{kind}"
        else:
            ours = ".".join(parts)
        if ours not in params:
            raise ValueError(f"model: unexpected weight {name!r} in checkpoint")
        target = params[ours].data
        if shard is not None:
            layer = self.layers[int(parts[1])]
            sizes = ([layer.q_size, layer.kv_size, layer.kv_size] if sub == "qkv_proj"
                     else [target.shape[0] // 2] * 2)
            offset = sum(sizes[:shard])
            target = target[offset:offset + sizes[shard]]
        if target.shape != tensor.shape:
            raise ValueError(f"model: weight {name!r} has shape {tuple(tensor.shape)}, "
                             f"expected {tuple(target.shape)}")
        target.copy_(tensor)
        loaded.add(ours if shard is None else f"{ours}#{shard}")
