"""The router live: `pagefleet router` in front of real `pagefleet engine` replicas
(tiny random-weight model), driven by the openai client and raw HTTP.

Passthrough is checked against calling an engine directly; failover by
SIGKILLing a replica mid-run."""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from helpers import LiveServer, Proc, assert_error, free_port, scripted_upstream, spawn_engine, sse_events, wait_until

from pagefleet.router.app import REPLICA_HEADER, Router, RouterSettings, build_app
from pagefleet.router.policy import Policy
from pagefleet.router.pool import Pool

MODEL = "tiny"
pytestmark = pytest.mark.slow

# Fields that differ between any two calls (request ids, timestamps); everything else must match.
_VOLATILE = re.compile(rb'"(id|created)":\s*("[^"]*"|\d+)')


def _mask(raw: bytes) -> bytes:
    return _VOLATILE.sub(rb'"\1":"*"', raw)


def spawn_router(tmp: Path, urls: list[str], tokenizer: Path | None, *extra: str) -> Proc:
    args = ["router", "--pool", f"main={MODEL}:{','.join(urls)}", "--scrape-interval", "0.2", *extra]
    if tokenizer is not None:
        args += ["--tokenizer", f"main={tokenizer}"]
    return Proc(args, tmp / "router.log", free_port())


class Cluster:
    def __init__(self, tmp: Path, model_dir: Path, n: int, *router_args: str) -> None:
        self.engines = [spawn_engine(model_dir, tmp / f"engine{i}.log", MODEL) for i in range(n)]
        self.router: Proc | None = None
        try:
            for e in self.engines:
                e.wait_healthy()
            self.router = spawn_router(tmp, [e.url for e in self.engines], model_dir, *router_args)
            self.router.wait_healthy(60)
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        for p in [self.router, *self.engines]:
            if p is not None:
                p.stop()


@pytest.fixture(scope="module")
def cluster(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    c = Cluster(tmp_path_factory.mktemp("cluster"), tiny_llama, 3)
    yield c
    c.stop()


def _post(url: str, path: str, body: dict, **kw) -> httpx.Response:
    return httpx.post(url + path, json=body, timeout=60, **kw)


# ---- passthrough ----------------------------------------------------------------------------------


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"prompt": "The capital of France is", "max_tokens": 12, "logprobs": 2}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 12}),
])
@pytest.mark.parametrize("stream", [False, True])
def test_passthrough_is_byte_identical_to_the_engine(cluster: Cluster, path: str, body: dict, stream: bool) -> None:
    body = {"model": MODEL, "temperature": 0, "stream": stream, **body}
    direct = _post(cluster.engines[0].url, path, body)
    routed = _post(cluster.router.url, path, body)
    assert direct.status_code == routed.status_code == 200, routed.text
    assert routed.headers["content-type"] == direct.headers["content-type"]
    assert routed.headers[REPLICA_HEADER] in {e.url for e in cluster.engines}
    assert _mask(routed.content) == _mask(direct.content)
    if stream:
        assert routed.content.endswith(b"data: [DONE]\n\n")
        assert len(list(sse_events(routed.text.splitlines()))) > 3  # chunk by chunk, not one blob


def test_openai_client_through_the_router(cluster: Cluster) -> None:
    direct = openai.OpenAI(base_url=cluster.engines[1].url + "/v1", api_key="x")
    routed = openai.OpenAI(base_url=cluster.router.url + "/v1", api_key="x")
    kw = dict(model=MODEL, messages=[{"role": "user", "content": "Count to five."}], max_tokens=16, temperature=0)
    want = direct.chat.completions.create(**kw).choices[0].message.content
    assert routed.chat.completions.create(**kw).choices[0].message.content == want
    streamed = "".join(c.choices[0].delta.content or "" for c in routed.chat.completions.create(stream=True, **kw)
                       if c.choices)
    assert streamed == want
    assert [m.id for m in routed.models.list().data] == [MODEL]
    with pytest.raises(openai.NotFoundError):
        routed.completions.create(model="no-such-model", prompt="x", max_tokens=1)


def test_router_errors_health_and_metrics(cluster: Cluster) -> None:
    url = cluster.router.url
    assert _post(url, "/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 1}).status_code == 200
    assert_error(_post(url, "/v1/completions", {"model": "nope", "prompt": "x"}), 404, param="model",
                 code="model_not_found")
    assert_error(httpx.post(url + "/v1/completions", content=b"{not json", timeout=10), 400)
    # the engine's own validation errors pass through unchanged
    assert_error(_post(url, "/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": -1}), 400,
                 param="max_tokens")
    h = httpx.get(url + "/health", timeout=10)
    assert h.status_code == 200 and h.json()["pools"]["main"]["ready"] == 3
    text = httpx.get(url + "/metrics", timeout=10).text
    assert 'pagefleet:router_requests_total{outcome="ok",pool="main"' in text
    assert 'pagefleet:router_requests_total{outcome="client_error",pool="main"' in text
    assert 'pagefleet:router_requests_total{outcome="unknown_model",pool="",replica=""} ' in text
    assert 'pagefleet:router_replicas{pool="main",state="ready"} 3.0' in text
    assert "pagefleet:router_decision_seconds_bucket" in text
    assert "pagefleet:router_prefix_match_fraction_bucket" in text


def test_shared_prefix_sticks_to_one_replica(cluster: Cluster) -> None:
    """Prefix-aware routing: prompts sharing a long prefix land where it is cached, and the
    engine confirms with prefix-cache hits; unrelated prompts still spread."""
    system = "You are a meticulous code reviewer for a payments company. " * 8
    homes = set()
    for i in range(4):
        r = _post(cluster.router.url, "/v1/completions", {"model": MODEL, "prompt": system + f"Question {i}:",
                                                          "max_tokens": 2})
        assert r.status_code == 200
        homes.add(r.headers[REPLICA_HEADER])
        time.sleep(0.05)
    assert len(homes) == 1, homes
    home = next(e for e in cluster.engines if e.url in homes)
    m = httpx.get(home.url + "/metrics", timeout=10).text
    hits = float(re.search(r'^pagefleet:prefix_cache_hits_total\{model_name="tiny"\} (\S+)', m, re.M).group(1))
    assert hits >= 3 * 64  # three repeats of a prefix of well over 64 tokens
    others = {_post(cluster.router.url, "/v1/completions", {"model": MODEL, "prompt": f"{w} " * 40,
                                                            "max_tokens": 1}).headers[REPLICA_HEADER]
              for w in ("alpha", "bravo", "charlie", "delta", "echo", "foxtrot")}
    assert len(others) >= 2


# ---- relay mechanics against a scripted upstream --------------------------------------------------------


def _router_for(urls: list[str], **settings) -> LiveServer:
    pool = Pool("main", "m")
    router = Router([pool], RouterSettings(scrape_interval=0.1, **settings))
    router.set_urls(pool, urls)
    return LiveServer(build_app(router), model="m")


def test_relay_is_exact_and_unbuffered() -> None:
    """The upstream holds everything after its first chunk until the client has that chunk:
    a relay that buffered would deadlock here (and time out)."""
    chunks = [b'data: {"a": 1}\n\n', b'data: {"b": "\xc3\xa9"}\n\n', b"partial-", b"line\n\n", b"data: [DONE]\n\n"]
    gate = threading.Event()
    up = LiveServer(scripted_upstream(chunks, gate=gate)).start(ready=False)
    rt = _router_for([up.url]).start(ready=True, timeout=10)
    try:
        got = b""
        with httpx.stream("POST", rt.url + "/v1/completions", json={"model": "m", "prompt": "x"}, timeout=10) as r:
            for part in r.iter_raw():
                got += part
                gate.set()
        assert got == b"".join(chunks)
    finally:
        gate.set()
        rt.stop()
        up.stop()


def test_client_disconnect_closes_the_upstream() -> None:
    chunks = [b"data: x\n\n"] * 200
    closed = threading.Event()
    up = LiveServer(scripted_upstream(chunks, gap=0.05, closed=closed)).start(ready=False)
    rt = _router_for([up.url]).start(ready=True, timeout=10)
    try:
        with httpx.stream("POST", rt.url + "/v1/completions", json={"model": "m", "prompt": "x"}, timeout=10) as r:
            next(r.iter_raw())
        assert closed.wait(5), "the upstream kept streaming to a client that left"
        wait_until(lambda: 'pagefleet:router_in_flight{pool="main",replica="' + up.url + '"} 0.0'
                   in rt.http.get("/metrics").text, 5, "the in-flight count to drop")
        assert 'outcome="client_disconnected"' in rt.http.get("/metrics").text
    finally:
        rt.stop()
        up.stop()


def test_busy_replica_429_moves_the_request_on() -> None:
    busy = LiveServer(scripted_upstream([b'{"error": "busy"}'], status=429)).start(ready=False)
    good = LiveServer(scripted_upstream([b"data: ok\n\n"])).start(ready=False)
    rt = _router_for([busy.url, good.url]).start(ready=True, timeout=10)
    try:
        for _ in range(4):
            r = rt.http.post("/v1/completions", json={"model": "m", "prompt": "x"})
            assert r.status_code == 200 and r.headers[REPLICA_HEADER] == good.url
        text = rt.http.get("/metrics").text
        assert 'pagefleet:router_retries_total{pool="main",reason="busy"}' in text
        # busy is not broken: 429s never count toward ejection
        assert not [ln for ln in text.splitlines() if ln.startswith("pagefleet:router_ejections_total")]
    finally:
        for s in (rt, busy, good):
            s.stop()


def test_model_picks_the_pool_and_session_sticks() -> None:
    ups = [LiveServer(scripted_upstream([f"data: {i}\n\n".encode()])).start(ready=False) for i in range(3)]
    small = Pool("small", "m-small", policy=Policy.SESSION)
    large = Pool("large", "m-large", policy=Policy.SESSION)
    router = Router([small, large], RouterSettings(scrape_interval=0.1))
    router.set_urls(small, [ups[0].url])
    router.set_urls(large, [ups[1].url, ups[2].url])
    rt = LiveServer(build_app(router)).start(ready=True, timeout=10)
    try:
        assert [m["id"] for m in rt.http.get("/v1/models").json()["data"]] == ["m-small", "m-large"]
        assert rt.http.post("/v1/completions", json={"model": "m-small", "prompt": "x"}).content == b"data: 0\n\n"
        for session in ("alice", "bob", "carol", "dave"):
            served = {rt.http.post("/v1/completions", json={"model": "m-large", "prompt": "x"},
                                   headers={"x-session-id": session}).headers[REPLICA_HEADER] for _ in range(4)}
            assert len(served) == 1 and served <= {ups[1].url, ups[2].url}
        r = rt.http.get("/v1/nothing-here")
        assert_error(r, 404)
    finally:
        rt.stop()
        for u in ups:
            u.stop()


def test_503_with_retry_after_when_no_replica_answers() -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    rt = _router_for([dead]).start(ready=False)
    try:
        assert rt.http.get("/health").status_code == 503
        r = rt.http.post("/v1/completions", json={"model": "m", "prompt": "x"})
        assert_error(r, 503, code="no_replica_available")
        assert int(r.headers["retry-after"]) >= 1
    finally:
        rt.stop()


def test_5xx_before_streaming_is_retried_on_another_replica() -> None:
    bad = LiveServer(scripted_upstream([b'{"error": "boom"}'], status=500)).start(ready=False)
    good = LiveServer(scripted_upstream([b"data: ok\n\n"])).start(ready=False)
    rt = _router_for([bad.url, good.url]).start(ready=True, timeout=10)
    try:
        for _ in range(4):  # whichever the rotation picks first, the answer comes from the good one
            r = rt.http.post("/v1/completions", json={"model": "m", "prompt": "x"})
            assert r.status_code == 200 and r.content == b"data: ok\n\n"
            assert r.headers[REPLICA_HEADER] == good.url
        text = rt.http.get("/metrics").text
        assert 'pagefleet:router_retries_total{pool="main",reason="status_5xx"}' in text
    finally:
        for s in (rt, bad, good):
            s.stop()


# ---- failover: SIGKILL a replica mid-run ------------------------------------------------------------------


def test_sigkill_mid_run_loses_no_request(tiny_llama: Path, tmp_path: Path) -> None:
    c = Cluster(tmp_path, tiny_llama, 2, "--policy", "round-robin")
    victim, survivor = c.engines
    results: list[tuple[str, object]] = []
    started = threading.Barrier(7, timeout=60)  # the 6 streams have their first chunk, and this thread

    def run(i: int) -> None:
        stream = (i // 2) % 2 == 0  # S S P P S S ...: whatever the rotation, both replicas get both kinds
        body = {"model": MODEL, "prompt": f"request {i}", "max_tokens": 300, "ignore_eos": True, "stream": stream}
        try:
            with httpx.stream("POST", c.router.url + "/v1/completions", json=body, timeout=60) as r:
                if not stream:  # sent together with the streams; it answers only when done
                    r.read()
                    results.append(("ok", r.json()) if r.status_code == 200 else ("error", r.status_code))
                    return
                events = []
                for n, ev in enumerate(sse_events(r.iter_lines())):
                    events.append(ev)
                    if n == 0:
                        started.wait()
                if r.status_code != 200:
                    results.append(("error", r.status_code))
                elif events[-1] == "[DONE]":
                    results.append(("ok", events))
                else:
                    assert "error" in events[-1], events[-1]
                    results.append(("error", events[-1]))
        except (httpx.TransportError, threading.BrokenBarrierError) as e:
            results.append(("transport", repr(e)))

    try:
        threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(12)]
        for t in threads:
            t.start()
        started.wait()  # every stream is in flight, and the plain requests were sent with them
        victim.proc.kill()
        for t in threads:
            t.join(timeout=90)
        assert not any(t.is_alive() for t in threads), "a request hung after its replica died"
        assert len(results) == 12, results  # none lost
        assert all(kind in ("ok", "error") for kind, _ in results), results  # errors are HTTP answers
        ok = [v for kind, v in results if kind == "ok"]
        assert len(ok) >= 6  # at least the survivor's share completed in full
        # Plain requests send nothing before they finish, so the victim's were retried on the
        # survivor: all six complete. Only streams already under way can end in an error event.
        plain = [v for v in ok if isinstance(v, dict)]
        assert len(plain) == 6 and all(v["usage"]["completion_tokens"] == 300 for v in plain)
        assert any(kind == "error" for kind, _ in results), "the victim served no stream: nothing was tested"
        # new requests all go to the survivor, and succeed
        for i in range(6):
            r = _post(c.router.url, "/v1/completions", {"model": MODEL, "prompt": f"after {i}", "max_tokens": 2})
            assert r.status_code == 200 and r.headers[REPLICA_HEADER] == survivor.url
        wait_until(lambda: httpx.get(c.router.url + "/health", timeout=5).json()["pools"]["main"]["ready"] == 1,
                   10, "the router to drop the dead replica")
    finally:
        c.stop()


def test_metrics_parser_agrees_with_prometheus_client_on_a_real_engine(cluster: Cluster) -> None:
    """The router's line parser reads only what it needs; on a live engine's exposition
    (after traffic, histograms filled) it must agree with the reference parser."""
    from prometheus_client.parser import text_string_to_metric_families

    from pagefleet.router.scrape import parse_engine_metrics

    _post(cluster.engines[2].url, "/v1/completions", {"model": MODEL, "prompt": "warm " * 40, "max_tokens": 4})
    _post(cluster.engines[2].url, "/v1/completions", {"model": MODEL, "prompt": "warm " * 40, "max_tokens": 4})
    text = httpx.get(cluster.engines[2].url + "/metrics", timeout=10).text
    ref = {s.name: s for fam in text_string_to_metric_families(text) for s in fam.samples}
    snap = parse_engine_metrics(text)
    assert snap is not None
    assert snap.running == ref["pagefleet:num_requests_running"].value
    assert snap.waiting == ref["pagefleet:num_requests_waiting"].value
    assert snap.kv_usage == ref["pagefleet:kv_cache_usage_perc"].value
    assert snap.prefix_cache_queries == ref["pagefleet:prefix_cache_queries_total"].value > 0
    assert snap.prefix_cache_hits == ref["pagefleet:prefix_cache_hits_total"].value > 0
    info = ref["pagefleet:cache_config_info"].labels
    assert (snap.block_size, snap.num_blocks) == (int(info["block_size"]), int(info["num_blocks"]))
