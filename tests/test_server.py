"""The OpenAI-compatible HTTP server against live uvicorn servers (in-process and the CLI).

One module-scoped server (tiny random Llama, fp32) serves most tests; tests that
need other settings (a loading gate, a one-slot queue, SIGTERM) start their own.
The official `openai` client is the main client: if it can parse our answers, so
can the tools built on it.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from helpers import LiveServer, assert_error, free_port, raw_post, sse_events, wait_until
from transformers import AutoTokenizer

from pagefleet.engine import LLM, SamplingParams
from pagefleet.engine.config import EngineConfig
from pagefleet.engine.llm_engine import LLMEngine
from pagefleet.engine.server import build_app

MODEL = "tiny"
MAX_MODEL_LEN = 512


def engine_config(model_dir: Path, **overrides) -> EngineConfig:
    kw = dict(model=str(model_dir), dtype="float32", kv_cache_memory="16MiB", max_model_len=MAX_MODEL_LEN,
              served_model_name=MODEL)
    kw.update(overrides)
    return EngineConfig(**kw)


def metric(samples: dict, name: str, **labels) -> float:
    key = (name, tuple(sorted({"model_name": MODEL, **labels}.items())))
    return samples.get(key, 0.0)


# ---- fixtures -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def live(tiny_llama: Path) -> Iterator[LiveServer]:
    srv = LiveServer(build_app(lambda: LLMEngine(engine_config(tiny_llama)), MODEL)).start()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def tok(tiny_llama: Path):
    return AutoTokenizer.from_pretrained(str(tiny_llama))


@pytest.fixture(scope="module")
def client(live: LiveServer) -> Iterator[openai.OpenAI]:
    c = openai.OpenAI(base_url=f"{live.url}/v1", api_key="x", max_retries=0, timeout=60)
    yield c
    c.close()


@pytest.fixture(scope="module")
def offline(tiny_llama: Path) -> LLM:
    return LLM(model=str(tiny_llama), dtype="float32", kv_cache_memory="16MiB", max_model_len=MAX_MODEL_LEN)


def serves_ok(srv: LiveServer) -> None:
    """The server still answers a normal request."""
    r = srv.completion(prompt="still alive?", max_tokens=2, ignore_eos=True)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 2


# ---- plain endpoints ----------------------------------------------------------------------


def test_health_models_and_metrics_endpoints(live: LiveServer, client: openai.OpenAI) -> None:
    assert live.http.get("/health").json() == {"status": "ok"}
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    samples = live.metrics()
    for name in ("pagefleet:num_requests_running", "pagefleet:num_requests_waiting",
                 "pagefleet:kv_cache_usage_perc", "pagefleet:prompt_tokens_total",
                 "pagefleet:generation_tokens_total", "pagefleet:prefix_cache_queries_total",
                 "pagefleet:prefix_cache_hits_total", "pagefleet:num_preemptions_total",
                 "pagefleet:time_to_first_token_seconds_count", "pagefleet:e2e_request_latency_seconds_count",
                 "pagefleet:inter_token_latency_seconds_count"):
        assert (name, (("model_name", MODEL),)) in samples, name
    info = [k for k in samples if k[0] == "pagefleet:cache_config_info"]
    assert len(info) == 1 and dict(info[0][1])["block_size"] == "16"
    assert all(dict(labels).get("model_name") == MODEL for _, labels in samples), "every series has model_name"


# ---- the official client: completions and chat --------------------------------------------


def test_completions_plain_stream_and_n(client: openai.OpenAI) -> None:
    prompt = "The quick brown fox"
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert r.object == "text_completion" and r.model == MODEL
    assert len(r.choices) == 1 and r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 8 and r.usage.total_tokens == r.usage.prompt_tokens + 8

    stream = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0, stream=True,
                                       extra_body={"ignore_eos": True})
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == r.choices[0].text
    assert chunks[-1].choices[0].finish_reason == "length"
    assert all(c.id == chunks[0].id for c in chunks)

    r2 = client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, n=2, seed=3, temperature=1,
                                   extra_body={"ignore_eos": True})
    assert sorted(c.index for c in r2.choices) == [0, 1]
    assert r2.usage.completion_tokens == 12
    assert all(c.finish_reason == "length" for c in r2.choices)

    texts, finishes = {0: "", 1: ""}, {}
    for c in client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, n=2, seed=3, temperature=1,
                                       stream=True, extra_body={"ignore_eos": True}):
        for ch in c.choices:
            texts[ch.index] += ch.text
            if ch.finish_reason:
                finishes[ch.index] = ch.finish_reason
    assert finishes == {0: "length", 1: "length"}
    # Same seed, same sequences: streaming and not give the same texts.
    assert texts == {c.index: c.text for c in r2.choices}


def test_chat_greedy_equals_offline_and_stream(client: openai.OpenAI, offline: LLM, tok) -> None:
    messages = [{"role": "system", "content": "You are terse."},
                {"role": "user", "content": "Describe a paged KV cache in one line."}]
    templated = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids = tok.encode(templated, add_special_tokens=False)
    expected = offline.generate([ids], SamplingParams(max_tokens=24, temperature=0))[0].outputs[0]
    assert expected.text, "the reference produced no text"

    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=24, temperature=0)
    assert r.object == "chat.completion"
    msg = r.choices[0].message
    assert msg.role == "assistant"
    assert msg.content == expected.text
    assert r.choices[0].finish_reason == expected.finish_reason
    assert r.usage.prompt_tokens == len(ids)
    assert r.usage.completion_tokens == len(expected.token_ids)

    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=24, temperature=0,
                                                 stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == \
        [expected.finish_reason]


def test_chat_n2_streaming(client: openai.OpenAI) -> None:
    messages = [{"role": "user", "content": "hi"}]
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=5, n=2, seed=11,
                                       extra_body={"ignore_eos": True})
    assert sorted(c.index for c in r.choices) == [0, 1] and r.usage.completion_tokens == 10
    texts = {0: "", 1: ""}
    usage = None
    for c in client.chat.completions.create(model=MODEL, messages=messages, max_tokens=5, n=2, seed=11,
                                            stream=True, stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True}):
        for ch in c.choices:
            texts[ch.index] += ch.delta.content or ""
        usage = c.usage or usage
    assert texts == {c.index: c.message.content for c in r.choices}
    assert usage is not None and usage.completion_tokens == 10 and usage.prompt_tokens == r.usage.prompt_tokens


def test_stop_strings(client: openai.OpenAI) -> None:
    prompt = "Once upon a time"
    full = client.completions.create(model=MODEL, prompt=prompt, max_tokens=40, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text
    # A stop string that first occurs strictly inside the greedy text.
    stop = next((m.group(0) for m in re.finditer(r"[A-Za-z]{2,}", full) if full.find(m.group(0)) > 0), None)
    assert stop is not None, f"no usable stop string in {full!r}"
    expected = full[:full.find(stop)]

    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=40, temperature=0,
                                  stop=[stop, "@@never@@"], extra_body={"ignore_eos": True})
    assert r.choices[0].text == expected
    assert r.choices[0].finish_reason == "stop"
    assert r.usage.completion_tokens < 40

    chunks = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=40, temperature=0, stop=stop,
                                            stream=True, extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == expected
    assert chunks[-1].choices[0].finish_reason == "stop"

    kept = client.completions.create(model=MODEL, prompt=prompt, max_tokens=40, temperature=0, stop=stop,
                                     extra_body={"ignore_eos": True, "include_stop_str_in_output": True})
    assert kept.choices[0].text == expected + stop


def test_seed_reproducibility(client: openai.OpenAI) -> None:
    def sample(seed: int) -> str:
        return client.completions.create(model=MODEL, prompt="Random words:", max_tokens=16, temperature=1,
                                         seed=seed, extra_body={"ignore_eos": True}).choices[0].text

    a, b = sample(1234), sample(1234)
    assert a == b
    assert any(sample(s) != a for s in (1, 2, 3)), "different seeds should give different samples"

    def chat(seed: int) -> str:
        return client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "go"}],
                                              max_tokens=12, temperature=1, seed=seed,
                                              extra_body={"ignore_eos": True}).choices[0].message.content

    assert chat(99) == chat(99)


def test_completion_logprobs(client: openai.OpenAI) -> None:
    r = client.completions.create(model=MODEL, prompt="Numbers: 1 2 3", max_tokens=6, temperature=0, logprobs=2,
                                  extra_body={"ignore_eos": True})
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 6
    assert "".join(lp.tokens) == r.choices[0].text or "\ufffd" in r.choices[0].text
    assert lp.text_offset == sorted(lp.text_offset)
    for token_lp, top in zip(lp.token_logprobs, lp.top_logprobs, strict=True):
        assert token_lp <= 0
        values = list(top.values())
        # 2 requested; two token ids can decode to the same text and share a key.
        assert 1 <= len(values) <= 2
        assert all(v <= 0 for v in values)
        assert values == sorted(values, reverse=True)
        assert token_lp == pytest.approx(values[0], abs=1e-5)  # greedy: the sampled token is the top one

    n_tokens = 0
    for c in client.completions.create(model=MODEL, prompt="Numbers: 1 2 3", max_tokens=6, temperature=0,
                                       logprobs=2, stream=True, extra_body={"ignore_eos": True}):
        if c.choices and c.choices[0].logprobs:
            assert all(v <= 0 for v in c.choices[0].logprobs.token_logprobs)
            n_tokens += len(c.choices[0].logprobs.tokens)
    assert n_tokens == 6


def test_chat_logprobs(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "count"}], max_tokens=6,
                                       temperature=0, logprobs=True, top_logprobs=2,
                                       extra_body={"ignore_eos": True})
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens == 6
    for entry in content:
        assert entry.logprob <= 0
        assert len(entry.top_logprobs) == 2
        values = [t.logprob for t in entry.top_logprobs]
        assert all(v <= 0 for v in values) and values == sorted(values, reverse=True)
        assert entry.logprob == pytest.approx(values[0], abs=1e-5)
        assert bytes(entry.bytes).decode("utf-8") == entry.token

    plain = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "count"}],
                                           max_tokens=3, temperature=0, logprobs=True,
                                           extra_body={"ignore_eos": True})
    assert all(e.top_logprobs == [] and e.logprob <= 0 for e in plain.choices[0].logprobs.content)
    none = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "count"}],
                                          max_tokens=3, temperature=0)
    assert none.choices[0].logprobs is None


# ---- concurrency and cancellation ---------------------------------------------------------


@pytest.mark.slow
def test_64_concurrent_streams(live: LiveServer, tok) -> None:
    prompts = [f"Request {i}: " + "tell me more " * (i % 7) for i in range(64)]
    max_tokens = [4 + i % 9 for i in range(64)]

    async def one(c: openai.AsyncOpenAI, prompt: str, mt: int):
        text, usage, finish = "", None, None
        stream = await c.completions.create(model=MODEL, prompt=prompt, max_tokens=mt, stream=True,
                                            stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True})
        async for chunk in stream:
            for ch in chunk.choices:
                text += ch.text
                finish = ch.finish_reason or finish
            usage = chunk.usage or usage
        return text, usage, finish

    async def main():
        async with openai.AsyncOpenAI(base_url=f"{live.url}/v1", api_key="x", max_retries=0, timeout=120) as c:
            return await asyncio.gather(*(one(c, p, mt) for p, mt in zip(prompts, max_tokens, strict=True)))

    before = live.metrics()
    results = asyncio.run(main())
    for prompt, mt, (_, usage, finish) in zip(prompts, max_tokens, results, strict=True):
        assert finish == "length"
        assert usage is not None
        assert usage.completion_tokens == mt
        assert usage.prompt_tokens == len(tok.encode(prompt))
        assert usage.total_tokens == usage.prompt_tokens + mt
    after = live.metrics()
    assert metric(after, "pagefleet:generation_tokens_total") - metric(before, "pagefleet:generation_tokens_total") \
        == sum(max_tokens)
    assert metric(after, "pagefleet:num_requests_running") == 0


@pytest.mark.slow
def test_client_disconnect_frees_the_engine(live: LiveServer) -> None:
    before = live.metrics()
    max_tokens = 480
    readers = []  # referenced until the end: a dropped line iterator would close its connection early
    with contextlib.ExitStack() as stack:
        for i in range(20):
            resp = stack.enter_context(live.http.stream(
                "POST", "/v1/completions",
                json={"model": MODEL, "prompt": f"stream {i}", "max_tokens": max_tokens, "ignore_eos": True,
                      "stream": True}))
            assert resp.status_code == 200
            readers.append(sse_events(resp.iter_lines()))
            for _ in range(2):
                assert isinstance(next(readers[-1]), dict)
        during = live.metrics()
        assert metric(during, "pagefleet:num_requests_running") == 20
    # All 20 connections are closed now: their requests must be aborted and their blocks freed.

    def idle():
        m = live.metrics()
        return (metric(m, "pagefleet:num_requests_running") == 0 and metric(m, "pagefleet:num_requests_waiting") == 0
                and metric(m, "pagefleet:kv_cache_usage_perc") == 0 and m)

    after = wait_until(idle, 10, "running/waiting/kv usage to drop to 0 after disconnects")
    generated = metric(after, "pagefleet:generation_tokens_total") - metric(before, "pagefleet:generation_tokens_total")
    assert generated < 20 * max_tokens / 2, f"{generated} tokens generated: the requests were not aborted"
    serves_ok(live)

    # Non-streaming requests whose clients give up are aborted too.
    before = live.metrics()

    outcomes: list[object] = []

    def impatient(i: int) -> None:
        with httpx.Client(base_url=live.url, timeout=httpx.Timeout(30, read=0.3)) as c:
            try:
                outcomes.append(c.post("/v1/completions", json={
                    "model": MODEL, "prompt": f"wait {i}", "max_tokens": max_tokens, "ignore_eos": True}))
            except httpx.ReadTimeout as e:
                outcomes.append(e)

    threads = [threading.Thread(target=impatient, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert len(outcomes) == 4 and all(isinstance(o, httpx.ReadTimeout) for o in outcomes), outcomes
    after = wait_until(idle, 10, "abandoned non-streaming requests to be aborted")
    generated = metric(after, "pagefleet:generation_tokens_total") - metric(before, "pagefleet:generation_tokens_total")
    assert generated < 4 * max_tokens / 2, f"{generated} tokens generated: the requests were not aborted"
    serves_ok(live)


# ---- bad input ----------------------------------------------------------------------------

_BAD_REQUESTS = [
    # (id, path, body (dict or raw bytes), status, param, code)
    ("malformed-json", "/v1/completions", b'{"model": "tiny", "prompt": ', 400, None, None),
    ("not-an-object", "/v1/chat/completions", b"[1, 2, 3]", 400, None, None),
    ("wrong-type-max-tokens", "/v1/completions", {"prompt": "hi", "max_tokens": "ten"}, 400, "max_tokens", None),
    ("wrong-type-temperature", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "hi"}], "temperature": "hot"}, 400, "temperature", None),
    ("wrong-type-messages", "/v1/chat/completions", {"messages": "hi"}, 400, "messages", None),
    ("missing-prompt", "/v1/completions", {}, 400, "prompt", None),
    ("missing-messages", "/v1/chat/completions", {}, 400, "messages", None),
    ("missing-model", "/v1/completions", {"model": None, "prompt": "hi"}, 400, "model", None),
    ("negative-max-tokens", "/v1/completions", {"prompt": "hi", "max_tokens": -1}, 400, "max_tokens", None),
    ("top-p-zero", "/v1/completions", {"prompt": "hi", "top_p": 0}, 400, "top_p", None),
    ("bad-role", "/v1/chat/completions", {"messages": [{"role": "wizard", "content": "hi"}]}, 400, None, None),
    ("unknown-model", "/v1/completions", {"model": "gpt-9", "prompt": "hi"}, 404, "model", "model_not_found"),
    ("unknown-model-chat", "/v1/chat/completions", {"model": "gpt-9", "messages": [{"role": "user", "content": "x"}]},
     404, "model", "model_not_found"),
    ("prompt-too-long-ids", "/v1/completions", {"prompt": [7] * (MAX_MODEL_LEN + 10)}, 400, "prompt", None),
    ("prompt-too-long-text", "/v1/completions", {"prompt": "lorem ipsum " * MAX_MODEL_LEN}, 400, "prompt", None),
    ("prompt-plus-max-tokens-too-long", "/v1/completions", {"prompt": "hi", "max_tokens": MAX_MODEL_LEN}, 400,
     "max_tokens", None),
    ("token-id-out-of-vocab", "/v1/completions", {"prompt": [10**6]}, 400, "prompt", None),
    ("min-tokens-over-max", "/v1/completions", {"prompt": "hi", "max_tokens": 2, "min_tokens": 3}, 400,
     "min_tokens", None),
    ("lone-surrogate", "/v1/chat/completions", b'{"model": "tiny", "messages": [{"role": "user", "content": '
     b'"a\\ud800b"}]}', 400, None, None),
]


@pytest.mark.parametrize(("path", "body", "status", "param", "code"), [r[1:] for r in _BAD_REQUESTS],
                         ids=[r[0] for r in _BAD_REQUESTS])
def test_bad_input_gets_openai_error(live: LiveServer, path, body, status, param, code) -> None:
    if isinstance(body, bytes):
        r = live.http.post(path, content=body, headers={"content-type": "application/json"})
    else:
        r = live.http.post(path, json={"model": MODEL, **body} if "model" not in body else
                           {k: v for k, v in body.items() if v is not None})
    assert_error(r, status, param=param, code=code)
    serves_ok(live)


def test_openai_client_raises_typed_errors(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="nope", prompt="hi", max_tokens=1)
    assert e.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], top_p=0)
    assert e.value.param == "top_p"
    with pytest.raises(openai.BadRequestError):  # streaming errors are statuses too, before any chunk
        client.completions.create(model=MODEL, prompt="hi", max_tokens=MAX_MODEL_LEN, stream=True)


# ---- admission control and readiness (own servers) ----------------------------------------


@pytest.mark.slow
def test_queue_overflow_is_429_and_latency_metrics(tiny_llama: Path) -> None:
    def slow_engine() -> LLMEngine:
        # One sequence at a time and a slowed step: a second request has to wait.
        engine = LLMEngine(engine_config(tiny_llama, max_num_seqs=1))
        step = engine.step

        def slow_step():
            time.sleep(0.02)
            return step()

        engine.step = slow_step
        return engine

    srv = LiveServer(build_app(slow_engine, MODEL, max_queue=1)).start()
    try:
        body = {"model": MODEL, "prompt": "hold the slot", "max_tokens": 480, "ignore_eos": True}
        with srv.http.stream("POST", "/v1/completions", json={**body, "stream": True}) as a:
            assert a.status_code == 200
            a_events = sse_events(a.iter_lines())  # keep a reference: a dropped iterator closes the connection
            assert isinstance(next(a_events), dict)  # A is running

            def queue_stats() -> tuple[float, float]:
                m = srv.metrics()
                return metric(m, "pagefleet:num_requests_waiting"), metric(m, "pagefleet:num_requests_running")

            # A client that leaves while its request still waits in the queue (streaming:
            # no response has started yet; or not) frees its place at once, not when it is scheduled.
            for stream in (True, False):
                sock = raw_post(srv.port, "/v1/completions", {**body, "stream": stream})
                wait_until(lambda: queue_stats() == (1, 1), 10, "the raw request to wait")
                sock.close()
                wait_until(lambda: queue_stats()[0] == 0, 5, f"the abandoned queued request (stream={stream}) "
                                                             "to leave the queue")
                assert queue_stats()[1] == 1, "A must still be running"

            waiting: dict = {}

            def second():  # B waits for the only slot
                with httpx.Client(base_url=srv.url, timeout=60) as c:
                    waiting["resp"] = c.post("/v1/completions", json={**body, "max_tokens": 3})

            b = threading.Thread(target=second, daemon=True)
            b.start()
            wait_until(lambda: metric(srv.metrics(), "pagefleet:num_requests_waiting") == 1, 10,
                       "the second request to wait")

            r = srv.completion(prompt="one too many", max_tokens=2)
            err = assert_error(r, 429, code="rate_limit_exceeded")
            assert err["type"] == "rate_limit_exceeded"
            assert int(r.headers["retry-after"]) >= 1
            rs = srv.http.post("/v1/chat/completions", json={"model": MODEL, "stream": True, "max_tokens": 2,
                                                             "messages": [{"role": "user", "content": "x"}]})
            assert_error(rs, 429, code="rate_limit_exceeded")
            assert "retry-after" in rs.headers
        # A's connection is closed: it is aborted and B gets the slot.
        b.join(timeout=30)
        assert not b.is_alive()
        assert waiting["resp"].status_code == 200, waiting["resp"].text
        assert waiting["resp"].json()["usage"]["completion_tokens"] == 3
        serves_ok(srv)

        # Latency histograms measure from the request's arrival: with >= 20 ms per step, a
        # streamed request's first token cannot come sooner than that.
        before = srv.metrics()
        with srv.http.stream("POST", "/v1/completions", json={**body, "max_tokens": 3, "stream": True}) as r:
            assert list(sse_events(r.iter_lines()))[-1] == "[DONE]"
        after = srv.metrics()

        def delta(name: str) -> float:
            return metric(after, name) - metric(before, name)

        assert delta("pagefleet:time_to_first_token_seconds_count") == 1
        assert delta("pagefleet:time_to_first_token_seconds_sum") >= 0.02
        assert delta("pagefleet:e2e_request_latency_seconds_sum") >= 0.06
        assert delta("pagefleet:inter_token_latency_seconds_count") == 2
        assert delta("pagefleet:inter_token_latency_seconds_sum") >= 0.04
    finally:
        srv.stop()


@pytest.mark.slow
def test_503_while_loading_then_serves(tiny_llama: Path) -> None:
    gate = threading.Event()

    def gated_engine() -> LLMEngine:
        assert gate.wait(timeout=120), "test never opened the gate"
        return LLMEngine(engine_config(tiny_llama))

    srv = LiveServer(build_app(gated_engine, MODEL)).start(ready=False)
    try:
        h = srv.http.get("/health")
        assert h.status_code == 503 and h.json()["status"] == "loading"
        r = srv.completion(prompt="hi", max_tokens=1)
        err = assert_error(r, 503, err_type="service_unavailable")
        assert "loading" in err["message"]
        assert "retry-after" in r.headers
        assert_error(srv.http.post("/v1/chat/completions", json={
            "model": MODEL, "messages": [{"role": "user", "content": "x"}], "stream": True}), 503)
        assert srv.http.get("/v1/models").json()["data"][0]["id"] == MODEL
        assert srv.http.get("/metrics").status_code == 200
        gate.set()
        srv.wait_healthy()
        serves_ok(srv)
    finally:
        gate.set()
        srv.stop()


def test_load_failure_is_503_failed() -> None:
    def broken() -> LLMEngine:
        raise RuntimeError("weights are corrupt")

    failures: list[BaseException] = []
    srv = LiveServer(build_app(broken, MODEL, on_load_failure=failures.append)).start(ready=False)
    try:
        wait_until(lambda: failures, 10, "the load failure to be reported")
        h = srv.http.get("/health")
        assert h.status_code == 503 and h.json()["status"] == "failed"
        assert "weights are corrupt" in h.json()["error"]
        err = assert_error(srv.completion(prompt="hi"), 503, err_type="service_unavailable")
        assert "failed to load" in err["message"]
    finally:
        srv.stop()


@pytest.mark.slow
def test_engine_crash_ends_requests_with_errors(tiny_llama: Path) -> None:
    boom = threading.Event()

    def fragile_engine() -> LLMEngine:
        engine = LLMEngine(engine_config(tiny_llama))
        step = engine.step

        def step_or_crash():
            if boom.is_set():
                raise RuntimeError("simulated device failure")
            time.sleep(0.005)
            return step()

        engine.step = step_or_crash
        return engine

    srv = LiveServer(build_app(fragile_engine, MODEL)).start()
    try:
        serves_ok(srv)
        body = {"model": MODEL, "prompt": "crash test", "max_tokens": 480, "ignore_eos": True}
        outcome: dict = {}
        t = threading.Thread(target=lambda: outcome.setdefault("resp", srv.completion(**body)))
        with srv.http.stream("POST", "/v1/completions", json={**body, "stream": True}) as s:
            events = sse_events(s.iter_lines())
            assert isinstance(next(events), dict)
            t.start()
            wait_until(lambda: metric(srv.metrics(), "pagefleet:num_requests_running") == 2, 10,
                       "both requests to run")
            boom.set()
            rest = list(events)
        # The stream had started (200): it ends with an in-band error, then [DONE].
        assert rest[-1] == "[DONE]"
        assert rest[-2]["error"]["type"] == "service_unavailable"
        # The non-streaming one had not answered yet: a plain 503.
        t.join(timeout=30)
        assert_error(outcome["resp"], 503, err_type="service_unavailable")
        h = srv.http.get("/health")
        assert h.status_code == 503 and h.json()["status"] == "failed"
        assert "simulated device failure" in h.json()["error"]
        assert_error(srv.completion(prompt="anyone?", max_tokens=1), 503, err_type="service_unavailable")
    finally:
        srv.stop()


# ---- metrics ------------------------------------------------------------------------------


def test_metrics_count_a_scripted_run(live: LiveServer, tok) -> None:
    prompts = ["alpha", "beta gamma", "delta epsilon zeta", "eta theta iota kappa", "lambda mu nu xi omicron pi"]
    max_tokens = [3, 5, 7, 9, 11]
    streamed = [False, True, False, True, False]
    before = live.metrics()
    for p, mt, s in zip(prompts, max_tokens, streamed, strict=True):
        body = {"model": MODEL, "prompt": p, "max_tokens": mt, "ignore_eos": True, "stream": s}
        if s:
            with live.http.stream("POST", "/v1/completions", json=body) as r:
                assert r.status_code == 200
                assert list(sse_events(r.iter_lines()))[-1] == "[DONE]"
        else:
            assert live.http.post("/v1/completions", json=body).status_code == 200
    after = live.metrics()

    def delta(name: str, **labels) -> float:
        return metric(after, name, **labels) - metric(before, name, **labels)

    assert delta("pagefleet:prompt_tokens_total") == sum(len(tok.encode(p)) for p in prompts)
    assert delta("pagefleet:generation_tokens_total") == sum(max_tokens)
    assert delta("pagefleet:request_success_total", finished_reason="length") == 5
    assert delta("pagefleet:request_success_total", finished_reason="stop") == 0
    assert delta("pagefleet:time_to_first_token_seconds_count") == 5
    assert delta("pagefleet:e2e_request_latency_seconds_count") == 5
    assert delta("pagefleet:request_queue_time_seconds_count") == 5
    # One token per step per request: every token after the first is one inter-token gap.
    assert delta("pagefleet:inter_token_latency_seconds_count") == sum(mt - 1 for mt in max_tokens)
    assert delta("pagefleet:e2e_request_latency_seconds_sum") >= delta("pagefleet:time_to_first_token_seconds_sum") > 0
    assert metric(after, "pagefleet:num_requests_running") == 0
    assert metric(after, "pagefleet:num_requests_waiting") == 0


# ---- fuzzing the OpenAPI schema -----------------------------------------------------------


@pytest.fixture(scope="module")
def fuzz_server(tiny_llama: Path) -> Iterator[LiveServer]:
    # A short context: huge max_tokens are rejected at once and every accepted request is short.
    srv = LiveServer(build_app(lambda: LLMEngine(engine_config(tiny_llama, max_model_len=96)), MODEL)).start()
    yield srv
    srv.stop()


@pytest.mark.slow
def test_fuzz_openapi_no_server_errors(fuzz_server: LiveServer) -> None:
    import schemathesis
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st
    from schemathesis.checks import not_a_server_error

    schema = schemathesis.openapi.from_url(f"{fuzz_server.url}/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    paths = {op.path for op in operations}
    assert {"/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics"} <= paths
    # Fixed examples by default (the same ~10 s every run); PAGEFLEET_FUZZ_EXAMPLES=500 explores
    # new random cases for a longer hunt.
    n_examples = int(os.environ.get("PAGEFLEET_FUZZ_EXAMPLES", 25))
    derandomize = "PAGEFLEET_FUZZ_EXAMPLES" not in os.environ
    seen: dict[int, int] = {}
    for op in operations:
        post = op.method.upper() == "POST"
        modes = [schemathesis.GenerationMode.POSITIVE, schemathesis.GenerationMode.NEGATIVE] if post else \
            [schemathesis.GenerationMode.POSITIVE]
        for mode in modes:
            @settings(max_examples=n_examples if post else 3, deadline=None, database=None, derandomize=derandomize,
                      suppress_health_check=list(HealthCheck))
            @given(case=op.as_strategy(generation_mode=mode), served_model=st.booleans())
            def check(case, served_model: bool) -> None:
                if served_model and isinstance(case.body, dict):
                    case.body["model"] = MODEL  # else nearly every case stops at 404 model_not_found
                response = case.call(base_url=fuzz_server.url, timeout=60)
                seen[response.status_code] = seen.get(response.status_code, 0) + 1
                assert response.status_code < 500, f"{case.method} {case.path} {case.body!r} -> " \
                                                   f"{response.status_code} {response.text[:500]}"
                case.validate_response(response, checks=[not_a_server_error])

            check()
    assert any(200 <= s < 300 for s in seen) and any(400 <= s < 500 for s in seen), seen
    assert fuzz_server.http.get("/health").status_code == 200
    serves_ok(fuzz_server)


# ---- SIGTERM drain (the CLI in a subprocess) ----------------------------------------------


@pytest.mark.slow
def test_sigterm_drains_in_flight_streams(tiny_llama: Path, tmp_path: Path) -> None:
    exe = Path(sys.executable).with_name("pagefleet")
    port = free_port()
    shutdown_timeout = 30
    log = (tmp_path / "engine.log").open("wb")
    proc = subprocess.Popen(
        [str(exe), "engine", "--model", str(tiny_llama), "--served-model-name", MODEL, "--port", str(port),
         "--kv-cache-memory", "16MiB", "--max-model-len", str(MAX_MODEL_LEN), "--dtype", "float32",
         "--shutdown-timeout", str(shutdown_timeout)],
        stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    url = f"http://127.0.0.1:{port}"
    http = httpx.Client(base_url=url, timeout=30)

    def health() -> int | None:
        try:
            return http.get("/health").status_code
        except httpx.TransportError:
            return None

    try:
        wait_until(lambda: health() == 200 or proc.poll() is not None, 120, "the CLI server to become healthy",
                   interval=0.2)
        assert proc.poll() is None, (tmp_path / "engine.log").read_text()

        events: list = []
        first_chunk = threading.Event()

        def stream() -> None:
            with httpx.Client(base_url=url, timeout=60) as c, c.stream("POST", "/v1/completions", json={
                    "model": MODEL, "prompt": "drain me", "max_tokens": 500, "ignore_eos": True, "stream": True,
                    "stream_options": {"include_usage": True}}) as r:
                assert r.status_code == 200
                for event in sse_events(r.iter_lines()):
                    events.append(event)
                    first_chunk.set()

        t = threading.Thread(target=stream, daemon=True)
        t.start()
        assert first_chunk.wait(60), "the stream never started"
        proc.send_signal(signal.SIGTERM)

        h = http.get("/health")
        assert h.status_code == 503 and h.json()["status"] == "draining"
        assert t.is_alive(), "the stream ended before the drain could be observed"
        r = http.post("/v1/completions", json={"model": MODEL, "prompt": "new", "max_tokens": 1})
        assert_error(r, 503, err_type="service_unavailable")

        t.join(timeout=shutdown_timeout)
        assert not t.is_alive()
        assert events[-1] == "[DONE]"
        assert events[-2]["usage"]["completion_tokens"] == 500
        finishes = [ch["finish_reason"] for e in events[:-1] for ch in e["choices"] if ch["finish_reason"]]
        assert finishes == ["length"]

        assert proc.wait(timeout=shutdown_timeout) == 0, (tmp_path / "engine.log").read_text()
        assert health() is None  # gone: connection refused
    finally:
        http.close()
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
        log.close()
