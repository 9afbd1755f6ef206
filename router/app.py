"""The router's HTTP front door: OpenAI endpoints proxied to a pool's replicas.

Thin I/O shell over the pure policy: read the body once, ask the pool for an
order of replicas, forward the raw bytes to the first that answers, and pass
its response through chunk by chunk (SSE streams are never buffered). A
connection error, 5xx or 429 before the response started moves the request to
the next replica; once bytes flowed to the client there is no retry, and a
broken upstream stream ends with an SSE error event, never silently.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Callable, Iterable
from contextlib import asynccontextmanager
from dataclasses import dataclass

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.types import Receive, Scope, Send

from pagefleet.engine.protocol import error_body
from pagefleet.router.metrics import CONTENT_TYPE, RouterMetrics
from pagefleet.router.pool import Plan, Pool, Replica
from pagefleet.router.scrape import scrape

logger = logging.getLogger(__name__)

# Per-connection headers (RFC 9110 7.6.1) and the ones each hop sets itself.
_HOP_HEADERS = frozenset({"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te",
                          "trailer", "transfer-encoding", "upgrade", "host", "content-length"})
_RESPONSE_DROP = frozenset({"connection", "keep-alive", "transfer-encoding", "te", "trailer", "upgrade",
                            "date", "server"})
REPLICA_HEADER = "x-pagefleet-replica"


@dataclass(frozen=True)
class RouterSettings:
    max_attempts: int = 3                 # replicas tried per request
    connect_timeout: float = 2.0
    upstream_timeout: float | None = 600.0  # max silence from a replica before giving up
    scrape_interval: float = 1.0
    scrape_timeout: float = 2.0
    session_header: str = "x-session-id"

    def __post_init__(self) -> None:
        if self.max_attempts < 1:
            raise ValueError("max_attempts: must be >= 1")
        if self.scrape_interval <= 0:
            raise ValueError("scrape_interval: must be > 0")


def _error(status: int, message: str, err_type: str, code: str | None = None, param: str | None = None,
           headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error_body(message, err_type, param, code), status_code=status, headers=headers)


class _Passthrough(Response):
    """Response relaying an upstream httpx response as it arrives.

    Races the relay against the client's disconnect, so a client that goes away
    closes the upstream connection at once (the engine then aborts the request and
    frees its blocks) instead of when the next chunk fails to send."""

    def __init__(self, upstream: httpx.Response, replica: str, on_done: Callable[[str], None]) -> None:
        # Deliberately not Response.__init__: there is no body to render, only one to relay.
        self.upstream, self.replica, self.on_done = upstream, replica, on_done
        self.status_code = upstream.status_code
        self.background = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        up = self.upstream
        headers = [(k, v) for k, v in up.headers.raw if k.decode("latin-1").lower() not in _RESPONSE_DROP]
        headers.append((REPLICA_HEADER.encode(), self.replica.encode()))
        outcome = "ok" if up.status_code < 400 else ("client_error" if up.status_code < 500 else "upstream_error")
        relay = asyncio.ensure_future(self._relay(send))
        watch = asyncio.ensure_future(self._wait_disconnect(receive))
        try:
            await send({"type": "http.response.start", "status": up.status_code, "headers": headers})
            await asyncio.wait({relay, watch}, return_when=asyncio.FIRST_COMPLETED)
            if relay.done():
                outcome = relay.result() or outcome
            else:
                outcome = "client_disconnected"
        finally:
            for t in (relay, watch):
                t.cancel()
            await asyncio.gather(relay, watch, return_exceptions=True)
            await up.aclose()
            self.on_done(outcome)

    async def _relay(self, send: Send) -> str | None:
        up = self.upstream
        try:
            async for chunk in up.aiter_raw():
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
        except httpx.HTTPError as e:
            logger.warning("replica %s broke off a response: %r", self.replica, e)
            if up.headers.get("content-type", "").startswith("text/event-stream"):
                err = error_body(f"the replica serving this request failed mid-stream: {type(e).__name__}",
                                 "service_unavailable", code="upstream_failed")
                await send({"type": "http.response.body", "body": f"data: {json.dumps(err)}\n\n".encode(),
                            "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
            return "midstream_error"
        await send({"type": "http.response.body", "body": b"", "more_body": False})
        return None

    @staticmethod
    async def _wait_disconnect(receive: Receive) -> None:
        while (await receive())["type"] != "http.disconnect":
            pass


class Router:
    def __init__(self, pools: Iterable[Pool], settings: RouterSettings | None = None,
                 metrics: RouterMetrics | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self.pools = list(pools)
        self.by_model: dict[str, Pool] = {}
        for p in self.pools:
            if p.model in self.by_model:
                raise ValueError(f"pools {self.by_model[p.model].name!r} and {p.name!r} both serve {p.model!r}")
            self.by_model[p.model] = p
        self.settings = settings or RouterSettings()
        self.metrics = metrics or RouterMetrics()
        self.clock = clock
        self.client: httpx.AsyncClient | None = None
        self.started = time.time()
        self._wake = asyncio.Event()

    # ---- replica bookkeeping -----------------------------------------------------------------

    def set_urls(self, pool: Pool, urls: Iterable[str]) -> None:
        """Discovery callback: new replicas are scraped at once instead of at the next tick."""
        added, _ = pool.set_urls(urls)
        if added:
            self._wake.set()

    def _failed(self, pool: Pool, replica: Replica) -> None:
        if replica.health.record_failure(self.clock(), pool.ejection):
            self.metrics.ejections.labels(pool.name, replica.url).inc()
            logger.warning("pool %s: ejected %s for %.0fs after repeated failures", pool.name, replica.url,
                           replica.health.retry_after(self.clock()))

    async def scrape_all(self) -> None:
        assert self.client is not None
        jobs = [(p, r) for p in self.pools for r in list(p.replicas.values())]

        async def one(pool: Pool, r: Replica) -> None:
            try:
                snap = await scrape(self.client, r.url, self.settings.scrape_timeout)
            except httpx.TimeoutException:
                return  # busy, not gone: keep the last snapshot
            except httpx.HTTPError:
                pool.observe(r.url, None)
                self._failed(pool, r)
                return
            pool.observe(r.url, snap)

        await asyncio.gather(*(one(p, r) for p, r in jobs))

    async def _scrape_loop(self) -> None:
        while True:
            try:
                await self.scrape_all()
            except Exception:
                logger.exception("scrape round failed")
            self._wake.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self.settings.scrape_interval)

    # ---- proxying --------------------------------------------------------------------------------

    async def proxy(self, request: Request, path: str, chat: bool) -> Response:
        raw = await request.body()
        try:
            body = json.loads(raw)
        except (ValueError, UnicodeDecodeError):
            return _error(400, "request body is not valid JSON", "invalid_request_error")
        if not isinstance(body, dict):
            return _error(400, "request body must be a JSON object", "invalid_request_error")
        model = body.get("model")
        pool = self.by_model.get(model) if isinstance(model, str) else None
        if pool is None:
            self.metrics.requests.labels("", "", "unknown_model").inc()
            return _error(404, f"The model `{model}` does not exist. Available: {', '.join(self.by_model)}",
                          "invalid_request_error", code="model_not_found", param="model")
        session = request.headers.get(self.settings.session_header)
        t0 = time.perf_counter()
        plan = pool.plan(body, chat, session, self.clock())
        self.metrics.decision_time.labels(pool.name).observe(time.perf_counter() - t0)
        headers = [(k, v) for k, v in request.headers.raw if k.decode("latin-1").lower() not in _HOP_HEADERS]
        return await self._forward(request, pool, plan, path, raw, headers, session)

    async def _forward(self, request: Request, pool: Pool, plan: Plan, path: str, raw: bytes, headers,
                       session: str | None) -> Response:
        assert self.client is not None
        last_error = "no ready replica"
        attempts = plan.order[: self.settings.max_attempts]
        for i, replica in enumerate(attempts):
            final = i == len(attempts) - 1
            self._open(pool, replica)
            t0 = time.perf_counter()
            try:
                req = self.client.build_request("POST", replica.url + path, content=raw, headers=headers)
                resp = await _unless_disconnected(request, self.client.send(req, stream=True))
            except httpx.HTTPError as e:
                self._close(pool, replica)
                self._failed(pool, replica)
                last_error = f"{replica.url}: {type(e).__name__}"
                logger.warning("pool %s: %s failed before responding (%r)%s", pool.name, replica.url, e,
                               "" if final else "; trying another replica")
                if not final:
                    self.metrics.retries.labels(pool.name, "connect").inc()
                continue
            except _ClientGone:
                self._close(pool, replica)
                self.metrics.requests.labels(pool.name, replica.url, "client_disconnected").inc()
                return Response(status_code=499)
            self.metrics.upstream_latency.labels(pool.name).observe(time.perf_counter() - t0)
            status = resp.status_code
            if status >= 500:
                self._failed(pool, replica)
            if (status >= 500 or status == 429) and not final:
                await resp.aclose()
                self._close(pool, replica)
                self.metrics.retries.labels(pool.name, "busy" if status == 429 else "status_5xx").inc()
                continue
            if status < 500:
                replica.health.record_success()
            if status < 400:
                pool.routed(replica, plan, session)
                if i == 0:
                    self.metrics.prefix_match.labels(pool.name).observe(plan.match)

            def done(outcome: str, replica: Replica = replica) -> None:
                self._close(pool, replica)
                if outcome == "midstream_error":
                    self._failed(pool, replica)
                self.metrics.requests.labels(pool.name, replica.url, outcome).inc()

            return _Passthrough(resp, replica.url, done)
        now = self.clock()
        self.metrics.requests.labels(pool.name, "", "no_replica").inc()
        retry = pool.retry_after(now)
        return _error(503, f"no replica of pool {pool.name!r} could take the request ({last_error}); "
                           f"retry in {retry}s", "service_unavailable", code="no_replica_available",
                      headers={"Retry-After": str(retry)})

    def _open(self, pool: Pool, r: Replica) -> None:
        r.in_flight += 1
        self.metrics.in_flight.labels(pool.name, r.url).set(r.in_flight)

    def _close(self, pool: Pool, r: Replica) -> None:
        r.in_flight -= 1
        assert r.in_flight >= 0
        self.metrics.in_flight.labels(pool.name, r.url).set(r.in_flight)

    # ---- status ------------------------------------------------------------------------------------

    def pool_status(self) -> dict[str, dict]:
        now = self.clock()
        out = {}
        for p in self.pools:
            ready = p.available(now)
            ejected = [r for r in p.replicas.values() if not r.health.available(now)]
            out[p.name] = {"model": p.model, "policy": p.policy.value, "replicas": len(p.replicas),
                           "ready": len(ready), "ejected": len(ejected)}
        return out

    def render_metrics(self) -> bytes:
        for name, s in self.pool_status().items():
            g = self.metrics.replicas
            g.labels(name, "ready").set(s["ready"])
            g.labels(name, "ejected").set(s["ejected"])
            g.labels(name, "not_ready").set(s["replicas"] - s["ready"] - s["ejected"])
        return self.metrics.render()


class _ClientGone(Exception):
    pass


async def _unless_disconnected(request: Request, coro):
    """Await `coro` unless the client disconnects first (then cancel it: closing the
    upstream connection is what tells the engine to abort the request)."""
    task = asyncio.ensure_future(coro)
    watch = asyncio.ensure_future(_Passthrough._wait_disconnect(request.receive))
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            return task.result()
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError, httpx.HTTPError):
            resp = await task
            await resp.aclose()
        raise _ClientGone
    finally:
        watch.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await watch


def build_app(router: Router, watchers: Iterable[Callable[[], asyncio.Future]] = ()) -> FastAPI:
    """`watchers` are coroutine factories run for the app's lifetime (e.g. EndpointSlice watches)."""

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        s = router.settings
        router.client = httpx.AsyncClient(
            timeout=httpx.Timeout(s.upstream_timeout, connect=s.connect_timeout),
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=256))
        tasks = [asyncio.ensure_future(router._scrape_loop())] + [asyncio.ensure_future(w()) for w in watchers]
        await router.scrape_all()  # so /health is truthful from the first request
        try:
            yield
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await router.client.aclose()

    app = FastAPI(title="pagefleet router", lifespan=lifespan)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await router.proxy(request, "/v1/completions", chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await router.proxy(request, "/v1/chat/completions", chat=True)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": p.model, "object": "model", "created": int(router.started),
                                            "owned_by": "pagefleet", "pool": p.name} for p in router.pools]}

    @app.get("/health")
    async def health():
        pools = router.pool_status()
        ok = all(s["ready"] > 0 for s in pools.values())
        return JSONResponse({"status": "ok" if ok else "unavailable", "pools": pools}, status_code=200 if ok else 503)

    @app.get("/metrics")
    async def prometheus_metrics():
        return Response(router.render_metrics(), media_type=CONTENT_TYPE)

    return app
