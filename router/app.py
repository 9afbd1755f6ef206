"""The router's HTTP front door: OpenAI endpoints proxied to a pool's replicas.

Thin I/O shell over the pure policy: read the body once, ask the pool for an
order of replicas, forward the raw bytes to the first that answers, and relay
its response chunk by chunk (SSE streams are never buffered). A connection
error, 5xx or 429 before the response started moves the request to the next
replica; once bytes flowed to the client there is no retry, and a broken
upstream stream ends with an SSE error event, never silently.

The two proxied endpoints are plain ASGI, not FastAPI routes, and upstream
calls use aiohttp: on a small CPU a framework's per-request overhead is most
of what a router adds to a request's latency. Everything else (/v1/models,
/health, /metrics, errors for unknown paths) is an ordinary FastAPI app.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Awaitable, Callable, Iterable
from contextlib import asynccontextmanager
from dataclasses import dataclass

import aiohttp
from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import Receive, Scope, Send

from pagefleet.engine.protocol import error_body
from pagefleet.router.metrics import CONTENT_TYPE, RouterMetrics
from pagefleet.router.pool import Plan, Pool, Replica
from pagefleet.router.scrape import parse_engine_metrics

logger = logging.getLogger(__name__)

PROXY_PATHS = {"/v1/completions": False, "/v1/chat/completions": True}  # path -> is chat
REPLICA_HEADER = "x-pagefleet-replica"
# Per-connection headers (RFC 9110 7.6.1) and the ones each hop sets itself.
_REQUEST_DROP = frozenset({"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te",
                           "trailer", "transfer-encoding", "upgrade", "host", "content-length", "expect"})
_RESPONSE_DROP = frozenset({b"connection", b"keep-alive", b"transfer-encoding", b"te", b"trailer", b"upgrade",
                            b"date", b"server"})
_EJECTING_STATUS = frozenset({502, 503, 504})  # the replica's fault; a 500 may be the request's
_SCRAPE_TIMEOUTS_TO_UNREADY = 3
_REPLICA_OUTCOMES = ("ok", "client_error", "upstream_error", "midstream_error", "client_disconnected")
_TOKENIZE_OFF_LOOP_BYTES = 16_384  # bigger bodies are tokenized in a thread, not on the event loop


@dataclass(frozen=True)
class RouterSettings:
    max_attempts: int = 3                   # replicas tried per request
    connect_timeout: float = 2.0
    upstream_timeout: float | None = 600.0  # max silence from a replica mid-request
    scrape_interval: float = 1.0
    scrape_timeout: float = 2.0
    session_header: str = "x-session-id"

    def __post_init__(self) -> None:
        if self.max_attempts < 1:
            raise ValueError("max_attempts: must be >= 1")
        if self.scrape_interval <= 0:
            raise ValueError("scrape_interval: must be > 0")


class _ClientGone(Exception):
    pass


async def _read_body(receive: Receive) -> bytes:
    chunks = []
    while True:
        msg = await receive()
        if msg["type"] == "http.disconnect":
            raise _ClientGone
        chunks.append(msg.get("body", b""))
        if not msg.get("more_body"):
            return b"".join(chunks)


async def _wait_disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def _unless_disconnected(gone: asyncio.Future, aw: Awaitable):
    """Await `aw` unless the client disconnects first (`gone` completes); then cancel it
    (closing the upstream connection is what tells the engine to abort the request)."""
    task = asyncio.ensure_future(aw)
    await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
    if task.done():
        return task.result()
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError, aiohttp.ClientError, asyncio.TimeoutError):
        (await task).close()
    raise _ClientGone


async def _send_json(send: Send, status: int, body: dict, headers: dict[str, str] | None = None) -> None:
    data = json.dumps(body).encode()
    raw = [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]
    raw += [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]
    await send({"type": "http.response.start", "status": status, "headers": raw})
    await send({"type": "http.response.body", "body": data})


class Router:
    def __init__(self, pools: Iterable[Pool], settings: RouterSettings | None = None,
                 metrics: RouterMetrics | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self.pools = list(pools)
        self.by_model: dict[str, Pool] = {}
        for p in self.pools:
            if p.model in self.by_model:
                raise ValueError(f"pools {self.by_model[p.model].name!r} and {p.name!r} both serve {p.model!r}")
            self.by_model[p.model] = p
        if len({p.name for p in self.pools}) != len(self.pools):
            raise ValueError("pool names must be unique")
        self.settings = settings or RouterSettings()
        self.metrics = metrics or RouterMetrics()
        self.clock = clock
        self.session: aiohttp.ClientSession | None = None
        self.started = time.time()
        self._wake = asyncio.Event()
        self._session_header = self.settings.session_header.lower().encode("latin-1")
        s = self.settings
        self._request_timeout = aiohttp.ClientTimeout(total=None, connect=s.connect_timeout,
                                                      sock_read=s.upstream_timeout)
        self._scrape_timeout = aiohttp.ClientTimeout(total=s.scrape_timeout)

    async def start(self) -> None:
        # auto_decompress=False: bytes are relayed exactly as the replica sent them.
        self.session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0, ttl_dns_cache=60),
                                             auto_decompress=False)

    async def close(self) -> None:
        if self.session is not None:
            await self.session.close()

    # ---- replica bookkeeping -----------------------------------------------------------------

    def set_urls(self, pool: Pool, urls: Iterable[str]) -> None:
        """Discovery callback: new replicas are scraped at once instead of at the next tick."""
        added, removed = pool.set_urls(urls)
        for url in removed:  # bounded label sets as pods come and go
            for outcome in _REPLICA_OUTCOMES:
                with contextlib.suppress(KeyError):
                    self.metrics.requests.remove(pool.name, url, outcome)
            with contextlib.suppress(KeyError):
                self.metrics.in_flight.remove(pool.name, url)
            with contextlib.suppress(KeyError):
                self.metrics.ejections.remove(pool.name, url)
        if added:
            self._wake.set()

    def _failed(self, pool: Pool, replica: Replica) -> None:
        if replica.health.record_failure(self.clock(), pool.ejection):
            self.metrics.ejections.labels(pool.name, replica.url).inc()
            logger.warning("pool %s: ejected %s for %.0fs after repeated failures", pool.name, replica.url,
                           replica.health.retry_after(self.clock()))

    async def _scrape(self, pool: Pool, r: Replica) -> None:
        """Readiness and load of one replica. Scrapes never eject (that is for requests that
        fail); a replica that does not answer is simply not ready until it does again."""
        assert self.session is not None
        try:
            async with self.session.get(f"{r.url}/health", timeout=self._scrape_timeout) as h:
                await h.read()
                if h.status != 200:  # loading, or draining after SIGTERM (its /metrics looks normal)
                    r.scrape_timeouts = 0
                    pool.observe(r.url, None)
                    return
            async with self.session.get(f"{r.url}/metrics", timeout=self._scrape_timeout) as m:
                text = await m.text()
                snap = parse_engine_metrics(text) if m.status == 200 else None
        except TimeoutError:
            # Busy is not gone: keep the last snapshot, but a replica that stays silent is hung.
            r.scrape_timeouts += 1
            if r.scrape_timeouts >= _SCRAPE_TIMEOUTS_TO_UNREADY:
                pool.observe(r.url, None)
            return
        except aiohttp.ClientError:
            pool.observe(r.url, None)
            return
        r.scrape_timeouts = 0
        pool.observe(r.url, snap)

    async def scrape_all(self) -> None:
        await asyncio.gather(*(self._scrape(p, r) for p in self.pools for r in list(p.replicas.values())))

    async def scrape_loop(self) -> None:
        while True:
            self._wake.clear()  # before the round: replicas added during it wake the next one
            try:
                await self.scrape_all()
            except Exception:
                logger.exception("scrape round failed")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self.settings.scrape_interval)

    # ---- proxying --------------------------------------------------------------------------------

    async def handle(self, scope: Scope, receive: Receive, send: Send, chat: bool) -> None:
        """ASGI handler of one proxied POST."""
        try:
            raw = await _read_body(receive)
        except _ClientGone:
            return
        try:
            body = json.loads(raw)
        except (ValueError, UnicodeDecodeError):
            return await _send_json(send, 400, error_body("request body is not valid JSON"))
        if not isinstance(body, dict):
            return await _send_json(send, 400, error_body("request body must be a JSON object"))
        model = body.get("model")
        pool = self.by_model.get(model) if isinstance(model, str) else None
        if pool is None:
            self.metrics.requests.labels("", "", "unknown_model").inc()
            return await _send_json(send, 404, error_body(
                f"The model `{model}` does not exist. Available: {', '.join(self.by_model)}",
                param="model", code="model_not_found"))
        headers, session = [], None
        for k, v in scope["headers"]:
            if k == self._session_header:
                session = v.decode("latin-1")
            name = k.decode("latin-1")
            if name not in _REQUEST_DROP:
                headers.append((name, v.decode("latin-1")))
        t0 = time.perf_counter()
        if len(raw) > _TOKENIZE_OFF_LOOP_BYTES and pool.needs_tokenizing(body, chat):
            hashes = await asyncio.to_thread(pool.routing_hashes, body, chat)
        else:
            hashes = None
        plan = pool.plan(body, chat, session, self.clock(), hashes=hashes)
        self.metrics.decision_time.labels(pool.name).observe(time.perf_counter() - t0)
        query = scope.get("query_string", b"")
        path = scope["path"] + ("?" + query.decode("latin-1") if query else "")
        # One watcher of the client's connection for the request's whole life (waiting for
        # the replica, then relaying): its completion means the client left.
        gone = asyncio.ensure_future(_wait_disconnect(receive))
        try:
            await self._forward(gone, send, pool, plan, path, raw, headers, session)
        finally:
            gone.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await gone

    async def _forward(self, gone: asyncio.Future, send: Send, pool: Pool, plan: Plan, path: str, raw: bytes,
                       headers: list[tuple[str, str]], session: str | None) -> None:
        assert self.session is not None
        last_error = "no ready replica"
        attempts = plan.order[: self.settings.max_attempts]
        for i, replica in enumerate(attempts):
            final = i == len(attempts) - 1
            self._open(pool, replica)
            # Recorded now, not when the answer starts: a burst sharing a prefix must find it
            # here while the first request is still prefilling it.
            pool.routed(replica, plan, session)
            t0 = time.perf_counter()
            try:
                resp = await _unless_disconnected(gone, self.session.post(
                    replica.url + path, data=raw, headers=headers, timeout=self._request_timeout))
            except (TimeoutError, aiohttp.ClientError) as e:
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
                return
            self.metrics.upstream_latency.labels(pool.name).observe(time.perf_counter() - t0)
            status = resp.status
            if status in _EJECTING_STATUS:
                self._failed(pool, replica)
            elif status < 500:
                replica.health.record_success()
            if (status >= 500 or status == 429) and not final:
                resp.close()
                self._close(pool, replica)
                self.metrics.retries.labels(pool.name, "busy" if status == 429 else "status_5xx").inc()
                continue
            if status < 400:
                self.metrics.prefix_match.labels(pool.name).observe(plan.match_of(replica))
            outcome = await self._relay(resp, replica, gone, send)
            self._close(pool, replica)
            if outcome == "midstream_error":
                self._failed(pool, replica)
            self.metrics.requests.labels(pool.name, replica.url, outcome).inc()
            return
        self.metrics.requests.labels(pool.name, "", "no_replica").inc()
        retry = pool.retry_after(self.clock())
        await _send_json(send, 503, error_body(
            f"no replica of pool {pool.name!r} could take the request ({last_error}); retry in {retry}s",
            "service_unavailable", code="no_replica_available"), {"Retry-After": str(retry)})

    async def _relay(self, resp: aiohttp.ClientResponse, replica: Replica, gone: asyncio.Future,
                     send: Send) -> str:
        """Pass the response through as it arrives, racing the client's disconnect: a client
        that goes away closes the upstream connection at once (the engine then aborts the
        request and frees its blocks), not when the next chunk fails to send."""
        status = resp.status
        outcome = "ok" if status < 400 else ("client_error" if status < 500 else "upstream_error")
        headers = [(k, v) for k, v in resp.raw_headers if k.lower() not in _RESPONSE_DROP]
        headers.append((REPLICA_HEADER.encode(), replica.url.encode()))
        sse = resp.headers.get("content-type", "").startswith("text/event-stream")
        clean = False
        try:
            await send({"type": "http.response.start", "status": status, "headers": headers})
            relay = asyncio.ensure_future(self._pump(resp, replica, send, sse))
            try:
                await asyncio.wait({relay, gone}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                relay.cancel()
                await asyncio.gather(relay, return_exceptions=True)
            if not relay.done() or relay.cancelled():
                return "client_disconnected"
            result = relay.result()
            clean = result is None
            return result or outcome
        except OSError:  # the client's socket broke while we wrote to it
            return "client_disconnected"
        finally:
            if clean:
                resp.release()  # the connection goes back to the pool
            else:
                resp.close()

    @staticmethod
    async def _pump(resp: aiohttp.ClientResponse, replica: Replica, send: Send, sse: bool) -> str | None:
        try:
            async for chunk in resp.content.iter_any():
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
        except (TimeoutError, aiohttp.ClientError) as e:
            logger.warning("replica %s broke off a response: %r", replica.url, e)
            if sse:
                err = error_body(f"the replica serving this request failed mid-stream: {type(e).__name__}",
                                 "service_unavailable", code="upstream_failed")
                await send({"type": "http.response.body", "body": f"data: {json.dumps(err)}\n\n".encode(),
                            "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
            return "midstream_error"
        await send({"type": "http.response.body", "body": b"", "more_body": False})
        return None

    def _open(self, pool: Pool, r: Replica) -> None:
        r.in_flight += 1
        self.metrics.in_flight.labels(pool.name, r.url).set(r.in_flight)

    def _close(self, pool: Pool, r: Replica) -> None:
        r.in_flight -= 1
        assert r.in_flight >= 0
        if pool.replicas.get(r.url) is r:  # a replica that left (and came back) has its own series
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


class RouterApp:
    """The ASGI app: proxied POSTs go straight to the router, the rest to FastAPI."""

    def __init__(self, router: Router, api: FastAPI) -> None:
        self.router, self.api = router, api

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST":
            chat = PROXY_PATHS.get(scope["path"])
            if chat is not None:
                return await self.router.handle(scope, receive, send, chat)
        await self.api(scope, receive, send)


def _log_crash(task: asyncio.Task) -> None:
    if not task.cancelled() and task.exception() is not None:
        logger.error("background task %s died: %r", task.get_name(), task.exception())


def build_app(router: Router, watchers: Iterable[Callable[[], Awaitable[None]]] = ()) -> RouterApp:
    """`watchers` are coroutine functions run for the app's lifetime (e.g. EndpointSlice watches)."""

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await router.start()
        await router.scrape_all()  # so /health is truthful from the first request
        tasks = [asyncio.ensure_future(router.scrape_loop())] + [asyncio.ensure_future(w()) for w in watchers]
        for t in tasks:
            t.add_done_callback(_log_crash)
        try:
            yield
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await router.close()

    api = FastAPI(title="pagefleet router", lifespan=lifespan)

    @api.exception_handler(StarletteHTTPException)
    async def _http_error(_, e: StarletteHTTPException):
        return JSONResponse(error_body(str(e.detail), "invalid_request_error" if e.status_code < 500 else
                                       "internal_error"), status_code=e.status_code, headers=e.headers)

    @api.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": p.model, "object": "model", "created": int(router.started),
                                            "owned_by": "pagefleet", "pool": p.name} for p in router.pools]}

    @api.get("/health")
    async def health():
        pools = router.pool_status()
        ok = all(s["ready"] > 0 for s in pools.values())
        return JSONResponse({"status": "ok" if ok else "unavailable", "pools": pools}, status_code=200 if ok else 503)

    @api.get("/metrics")
    async def prometheus_metrics():
        return Response(router.render_metrics(), media_type=CONTENT_TYPE)

    return RouterApp(router, api)
