"""Weight-only int8: the layer against the float reference, packing, and whole models
(greedy agreement and logits against the unquantized engine on the same weights)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from pagefleet.engine import LLM, SamplingParams
from pagefleet.engine.quant import Int8Linear, check_quantization, quantize_int8

PROMPTS = ["The quick brown fox", "def fibonacci(n):", "Paris is the capital of", "1, 2, 3, 4,"]


def test_int8_round_trip_is_within_half_a_step() -> None:
    torch.manual_seed(0)
    w = torch.randn(64, 96) * torch.logspace(-2, 1, 64)[:, None]  # rows of very different magnitude
    q, scale = quantize_int8(w)
    assert q.dtype == torch.int8 and scale.shape == (64,) and q.abs().max() <= 127
    err = (q.float() * scale[:, None] - w).abs()
    assert torch.all(err <= scale[:, None] / 2 + 1e-7)  # per-channel scales keep small rows precise


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("batch", [1, 7, 32])
def test_int8_linear_matches_the_float_layer(bias: bool, batch: int) -> None:
    torch.manual_seed(batch)
    lin = nn.Linear(128, 96, bias=bias)
    q = Int8Linear(lin)
    x = torch.randn(batch, 3, 128)
    out, ref = q(x), lin(x)
    assert out.shape == ref.shape and out.dtype == ref.dtype
    # exact against its own dequantized weights, up to bf16 rounding of the activations ...
    exact = x @ q.dequantized().T + (lin.bias if bias else 0)
    assert (out - exact).abs().max() <= 0.02 * exact.abs().max()
    # ... and the documented bound against the float layer: 2% of the output's range
    assert (out - ref).abs().max() <= 0.02 * ref.abs().max()


def test_quantization_choices_fail_clearly() -> None:
    for method, msg in (("int4", "not implemented yet"), ("fp8", "not implemented yet"), ("int3", "unknown")):
        with pytest.raises(ValueError, match=msg):
            check_quantization(method, torch.device("cpu"))
    with pytest.raises(ValueError, match="CPU"):
        check_quantization("int8", torch.device("cuda"))


def test_int8_model_agrees_with_float(tiny_llama: Path) -> None:
    """Teacher-forced, so one flipped token does not derail the rest: at every position of the
    float model's greedy continuation, does the int8 model pick the same next token, and how
    far apart are the two log-probabilities of that token?"""
    kw = dict(model=str(tiny_llama), dtype="float32", kv_cache_memory="8MiB", max_model_len=256)
    ref_llm, q_llm = LLM(**kw), LLM(**kw, quantization="int8")
    layers = q_llm.engine.core.model.layers
    assert sum(isinstance(m, Int8Linear) for m in q_llm.engine.core.model.modules()) == 4 * len(layers)
    tok = ref_llm.get_tokenizer()
    one = SamplingParams(max_tokens=1, temperature=0, logprobs=20)
    agree = total = 0
    worst = 0.0
    for prompt in PROMPTS:
        ref = ref_llm.generate([prompt], SamplingParams(max_tokens=16, temperature=0, ignore_eos=True,
                                                        logprobs=1))[0].outputs[0]
        ids = tok.encode(prompt)
        for k, t in enumerate(ref.token_ids):
            out = q_llm.generate([ids + ref.token_ids[:k]], one)[0].outputs[0]
            agree += out.token_ids[0] == t
            total += 1
            top = dict(out.logprobs[0].top)
            if t in top:
                worst = max(worst, abs(top[t] - ref.logprobs[k].token_logprob))
    rate = agree / total
    print(f"int8 teacher-forced greedy agreement with float: {agree}/{total} = {rate:.1%}; "
          f"max |delta logprob| of the float choice {worst:.3f}")
    assert rate >= 0.8
    assert worst < 0.5
