"""The offline API end to end: sampling features through LLM.generate, streaming
deltas through LLMEngine, and the `pagefleet generate` command."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM

from pagefleet.engine import LLM, SamplingParams
from pagefleet.engine.config import EngineConfig
from pagefleet.engine.llm_engine import LLMEngine

PROMPTS = ["def fibonacci(n):", "The quick brown fox", "import os\nimport sys\n", "Bonjour, ça va ? 😀"]


@pytest.fixture(scope="module")
def llm(tiny_llama):
    return LLM(model=str(tiny_llama), dtype="float32", kv_cache_memory="16MiB")


def test_seeded_sampling_is_reproducible_across_batches(llm):
    params = SamplingParams(max_tokens=16, temperature=1.0, top_p=0.9, seed=1234)
    alone = llm.generate([PROMPTS[0]], params)[0].outputs[0].token_ids
    crowd = llm.generate(PROMPTS[1:] + [PROMPTS[0]] + PROMPTS[1:],
                         [SamplingParams(max_tokens=16, temperature=1.0)] * 3 + [params]
                         + [SamplingParams(max_tokens=16, temperature=1.0)] * 3)
    assert crowd[3].outputs[0].token_ids == alone
    other = llm.generate([PROMPTS[0]], SamplingParams(max_tokens=16, temperature=1.0, top_p=0.9, seed=99))
    assert other[0].outputs[0].token_ids != alone


def test_n_sequences(llm):
    out = llm.generate([PROMPTS[1]], SamplingParams(n=3, max_tokens=12, temperature=1.0, seed=7))[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in out.outputs}) == 3, "n samples should differ"
    greedy = llm.generate([PROMPTS[1]], SamplingParams(n=2, max_tokens=12, temperature=0))[0]
    assert greedy.outputs[0].token_ids == greedy.outputs[1].token_ids


def test_stop_strings_and_stop_token_ids(llm):
    base = llm.generate([PROMPTS[2]], SamplingParams(max_tokens=30, temperature=0))[0].outputs[0]
    assert len(base.text) > 6
    stop = base.text[3:6]
    out = llm.generate([PROMPTS[2]], SamplingParams(max_tokens=30, temperature=0, stop=[stop]))[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == base.text[:base.text.index(stop)]
    kept = llm.generate([PROMPTS[2]], SamplingParams(max_tokens=30, temperature=0, stop=[stop],
                                                     include_stop_str_in_output=True))[0].outputs[0]
    assert kept.text == base.text[:base.text.index(stop) + len(stop)]
    tid = base.token_ids[4]
    out = llm.generate([PROMPTS[2]], SamplingParams(max_tokens=30, temperature=0, stop_token_ids=[tid]))[0]
    c = out.outputs[0]
    assert c.finish_reason == "stop" and c.stop_reason == tid
    assert c.token_ids == base.token_ids[:base.token_ids.index(tid) + 1]


def test_min_tokens_holds_off_stop_tokens(llm):
    eos = llm.engine.eos_token_ids
    assert eos, "tiny model has an eos id"
    # Force EOS to be likely with a stop_token_id list: min_tokens must hold it off.
    out = llm.generate([PROMPTS[0]], SamplingParams(max_tokens=20, min_tokens=20, temperature=0,
                                                    stop_token_ids=list(range(0, 500))))[0].outputs[0]
    assert len(out.token_ids) == 20 and out.finish_reason == "length"


def test_logprobs_match_hf(tiny_llama, llm):
    ids = llm.get_tokenizer().encode(PROMPTS[0])
    out = llm.generate([ids], SamplingParams(max_tokens=1, temperature=0, logprobs=3))[0].outputs[0]
    hf = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    with torch.inference_mode():
        ref = torch.log_softmax(hf(torch.tensor([ids])).logits[0, -1], -1)
    lp = out.logprobs[0]
    assert abs(lp.token_logprob - ref[out.token_ids[0]].item()) < 1e-4
    top = torch.topk(ref, 3)
    assert [t for t, _ in lp.top] == top.indices.tolist()
    assert all(abs(v - r) < 1e-4 for (_, v), r in zip(lp.top, top.values.tolist(), strict=True))


def test_text_matches_tokenizer_decode(llm):
    tok = llm.get_tokenizer()
    for out in llm.generate(PROMPTS, SamplingParams(max_tokens=24, temperature=0)):
        assert out.outputs[0].text == tok.decode(out.outputs[0].token_ids, skip_special_tokens=True)


def test_streaming_deltas_add_up_to_the_final_output(tiny_llama):
    engine = LLMEngine(EngineConfig(model=str(tiny_llama), dtype="float32", kv_cache_memory="16MiB"))
    params = SamplingParams(max_tokens=20, temperature=0, n=2, logprobs=1)
    engine.add_request("s", PROMPTS[3], params, stream=True)
    engine.add_request("f", PROMPTS[3], params)
    text, ids, lps, final = {0: "", 1: ""}, {0: [], 1: []}, {0: 0, 1: 0}, None
    n_deltas = 0
    while engine.has_unfinished():
        for out in engine.step():
            if out.request_id == "f":
                final = out
                continue
            n_deltas += 1
            for c in out.outputs:
                text[c.index] += c.text
                ids[c.index] += c.token_ids
                lps[c.index] += len(c.logprobs or [])
    assert n_deltas >= 20
    assert final is not None
    for c in final.outputs:
        assert text[c.index] == c.text and ids[c.index] == c.token_ids and lps[c.index] == len(c.token_ids)


def test_cli_generate(tiny_llama):
    out = subprocess.run([sys.executable, "-m", "pagefleet.operator.cli", "generate", "--model", str(tiny_llama),
                          "--dtype", "float32", "--kv-cache-memory", "8MiB", "--max-tokens", "5", "hello"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    llm = LLM(model=str(tiny_llama), dtype="float32", kv_cache_memory="8MiB")
    expected = llm.generate(["hello"], SamplingParams(max_tokens=5, temperature=0))[0].outputs[0].text
    assert out.stdout == expected + "\n"
    bad = subprocess.run([sys.executable, "-m", "pagefleet.operator.cli", "generate", "--model", "/nonexistent",
                          "hi"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "model:" in bad.stderr
