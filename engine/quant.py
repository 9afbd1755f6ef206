"""Weight-only quantization of the decoder's linear layers.

int8, per output channel: w ~= q * scale, q in [-127, 127], one scale per row.
The matmul is torch's fused CPU kernel (`aten._weight_int8pack_mm`), never a
dequantize-then-matmul in Python. On the 2-core dev machine (bench/int8_matmul.py,
docs/benchmarks.md) that kernel is ~4x faster than a float32 matmul at batch 1
when given bfloat16 activations, and ~3x *slower* when given float32 ones; so
activations are fed to it in bfloat16 (and the result cast back), which costs a
bfloat16 rounding of the layer's input on top of the weight error.

Embeddings and the LM head stay in the compute dtype. int4 and fp8 are not
implemented yet and are refused with a clear error.
"""

from __future__ import annotations

import torch
from torch import nn

QUANTIZATIONS = ("none", "int8")
_NOT_YET = ("int4", "fp8")


def check_quantization(method: str, device: torch.device) -> None:
    if method in _NOT_YET:
        raise ValueError(f"quantization: {method} is not implemented yet (supported: {', '.join(QUANTIZATIONS)})")
    if method not in QUANTIZATIONS:
        raise ValueError(f"quantization: unknown method {method!r} (supported: {', '.join(QUANTIZATIONS)})")
    if method == "int8" and device.type != "cpu":
        raise ValueError("quantization: int8 runs on CPU for now (the GPU kernel is not written yet)")


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-output-channel symmetric int8: (q [N, K] int8, scale [N] float32)."""
    w = weight.detach().float()
    scale = (w.abs().amax(dim=1) / 127).clamp(min=torch.finfo(torch.float32).tiny)
    q = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
    return q, scale


class Int8Linear(nn.Module):
    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        q, scale = quantize_int8(linear.weight)
        self.out_features, self.in_features = q.shape
        self.register_buffer("qweight", q)
        self.register_buffer("scales", scale.to(torch.bfloat16))
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach(), requires_grad=False)

    def dequantized(self) -> torch.Tensor:
        return self.qweight.float() * self.scales.float()[:, None]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        out = torch.ops.aten._weight_int8pack_mm(x.reshape(-1, shape[-1]).to(torch.bfloat16), self.qweight,
                                                 self.scales).to(x.dtype)
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*shape[:-1], self.out_features)


def quantize_model(model: nn.Module, method: str) -> int:
    """Replace the decoder layers' nn.Linear modules in place; returns how many."""
    if method == "none":
        return 0
    assert method == "int8"
    count = 0
    for layer in model.layers:
        for name, child in list(layer.named_children()):
            if isinstance(child, nn.Linear):
                setattr(layer, name, Int8Linear(child))
                count += 1
    return count


def weight_bytes(model: nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in list(model.parameters()) + list(model.buffers()))
