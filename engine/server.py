"""OpenAI-compatible HTTP server of one engine replica (FastAPI).

The model loads in a background thread after the server starts listening, so
/health can say 503 "loading" to a readiness probe instead of refusing
connections. Every error a client can cause is a 4xx in OpenAI's JSON shape;
a 5xx means the engine itself failed.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse

from pagefleet.engine.async_engine import AsyncEngine, EngineDeadError, QueueFullError
from pagefleet.engine.llm_engine import LLMEngine
from pagefleet.engine.metrics import CONTENT_TYPE, ServerMetrics
from pagefleet.engine.outputs import RequestOutput
from pagefleet.engine.protocol import ChatCompletionRequest, CompletionRequest, error_body
from pagefleet.engine.sampling_params import SamplingParams
from pagefleet.engine.tokenization import render_chat

logger = logging.getLogger(__name__)


class APIError(Exception):
    def __init__(self, status: int, message: str, err_type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, headers: dict | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.err_type = status, message, err_type
        self.param, self.code, self.headers = param, code, headers


@dataclass
class ServerState:
    model_name: str
    max_queue: int | None
    engine: AsyncEngine | None = None
    load_error: str | None = None
    draining: bool = False
    started: float = field(default_factory=time.time)


def _param_of(message: str) -> str | None:
    """Our ValueErrors start with the field name ('top_p must be ...', 'prompt: ...')."""
    head = message.split(" ", 1)[0].rstrip(":")
    return head if head.replace("_", "").isalpha() else None


def build_app(engine_factory: Callable[[], LLMEngine], model_name: str, max_queue: int | None = None,
              on_load_failure: Callable[[BaseException], None] | None = None) -> FastAPI:
    state = ServerState(model_name, max_queue)
    metrics = ServerMetrics(lambda: state.engine, model_name)

    async def load() -> None:
        try:
            engine = await asyncio.to_thread(engine_factory)
            async_engine = AsyncEngine(engine, max_queue)
            async_engine.start()
            state.engine = async_engine
            logger.info("model %s loaded; serving", model_name)
        except asyncio.CancelledError:
            raise  # the server is shutting down while loading: not a load failure
        except BaseException as e:  # noqa: BLE001 - reported through /health and the exit code
            logger.exception("model failed to load")
            state.load_error = f"{type(e).__name__}: {e}"
            if on_load_failure is not None:
                on_load_failure(e)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        task = asyncio.create_task(load())
        yield
        task.cancel()
        if state.engine is not None:
            state.engine.shutdown()

    app = FastAPI(title="pagefleet engine", version="0.1.0", lifespan=lifespan)
    app.state.server = state

    # ---- errors ----------------------------------------------------------------------------

    @app.exception_handler(APIError)
    async def _api_error(_: Request, e: APIError):
        return JSONResponse(error_body(e.message, e.err_type, e.param, e.code), status_code=e.status,
                            headers=e.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, e: RequestValidationError):
        errors = e.errors()
        first = errors[0] if errors else {}
        loc = [str(x) for x in first.get("loc", ()) if x != "body"]
        param = ".".join(loc) or None
        if first.get("type") == "json_invalid":
            message, param = "request body is not valid JSON", None
        else:
            message = "; ".join(f"{'.'.join(str(x) for x in err.get('loc', ()) if x != 'body') or 'body'}: "
                                f"{err.get('msg')}" for err in errors[:5])
        return JSONResponse(error_body(message, param=param), status_code=400)

    @app.exception_handler(ValueError)
    async def _value_error(_: Request, e: ValueError):
        return JSONResponse(error_body(str(e), param=_param_of(str(e))), status_code=400)

    @app.exception_handler(Exception)
    async def _internal_error(_: Request, e: Exception):
        logger.exception("internal error")
        return JSONResponse(error_body(f"internal error: {type(e).__name__}", "server_error"), status_code=500)

    def ready_engine() -> AsyncEngine:
        if state.draining:
            raise APIError(503, "server is shutting down", "service_unavailable", headers={"Retry-After": "1"})
        if state.engine is None:
            msg = f"model failed to load: {state.load_error}" if state.load_error else "model is loading"
            raise APIError(503, msg, "service_unavailable", headers={"Retry-After": "5"})
        if not state.engine.is_running:
            raise APIError(503, "engine is not running", "service_unavailable")
        return state.engine

    def check_model(name: str) -> None:
        if name != model_name:
            raise APIError(404, f"The model `{name}` does not exist. Available: {model_name}",
                           param="model", code="model_not_found")

    # ---- plain endpoints -------------------------------------------------------------------

    @app.get("/health")
    async def health():
        if state.engine is not None and state.engine.is_running and not state.draining:
            return {"status": "ok"}
        reason = ("draining" if state.draining else "failed" if state.load_error or state.engine is not None
                  else "loading")
        error = state.load_error
        if error is None and state.engine is not None and state.engine.error is not None:
            error = f"engine step loop crashed: {state.engine.error!r}"
        return JSONResponse({"status": reason, "error": error}, status_code=503)

    @app.get("/metrics")
    async def prometheus_metrics():
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/v1/models")
    async def models():
        card = {"id": model_name, "object": "model", "created": int(state.started), "owned_by": "pagefleet"}
        if state.engine is not None:
            card["max_model_len"] = state.engine.engine.core.max_model_len
        return {"object": "list", "data": [card]}

    # ---- generation ------------------------------------------------------------------------

    def prepare(ae: AsyncEngine, prompts: list[str | list[int]], params_of: Callable[[int], SamplingParams],
                add_special_tokens: bool = True) -> list[tuple[list[int], SamplingParams]]:
        """Tokenize and validate everything before anything is queued."""
        engine, limit = ae.engine, ae.engine.core.max_model_len
        out = []
        for p in prompts:
            if isinstance(p, str) and p and not add_special_tokens:
                p = engine.encode(p, chat=True)
            ids = engine.validate(p, SamplingParams())
            params = params_of(len(ids))
            if len(ids) + params.max_tokens > limit:
                raise ValueError(f"max_tokens: this model's maximum context length is {limit} tokens, but "
                                 f"{len(ids)} prompt tokens + max_tokens={params.max_tokens} exceeds it")
            engine.validate(ids, params)
            out.append((ids, params))
        return out

    async def run_all(ae: AsyncEngine, prefix: str, jobs,
                      cache_salt: str | None) -> AsyncIterator[tuple[int, RequestOutput]]:
        """Merge the delta streams of several engine requests (one per prompt)."""
        q: asyncio.Queue = asyncio.Queue()
        done = object()

        async def pump(i: int, ids: list[int], params: SamplingParams) -> None:
            try:
                async for out in ae.generate(ae.new_request_id(prefix), ids, params, cache_salt):
                    q.put_nowait((i, out))
            except BaseException as e:  # noqa: BLE001 - re-raised in the consumer
                q.put_nowait(e)
            finally:
                q.put_nowait(done)

        tasks = [asyncio.create_task(pump(i, ids, p)) for i, (ids, p) in enumerate(jobs)]
        try:
            remaining = len(tasks)
            while remaining:
                item = await q.get()
                if item is done:
                    remaining -= 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    yield item
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def watch_disconnect(raw: Request, coro):
        """Run a non-streaming generation; if the client goes away, cancel it (which aborts
        the engine requests and frees their blocks) instead of computing for nobody."""
        task = asyncio.create_task(coro)
        while True:
            done, _ = await asyncio.wait({task}, timeout=0.5)
            if done:
                return task.result()
            if await raw.is_disconnected():
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
                return Response(status_code=499)

    def engine_errors(e: BaseException) -> APIError:
        if isinstance(e, QueueFullError):
            return APIError(429, f"too many requests waiting: {e}", "rate_limit_exceeded",
                            code="rate_limit_exceeded", headers={"Retry-After": "1"})
        if isinstance(e, EngineDeadError):
            return APIError(503, str(e), "service_unavailable")
        raise e

    def sse(obj: dict | str) -> str:
        return f"data: {obj if isinstance(obj, str) else json.dumps(obj, ensure_ascii=False)}\n\n"

    def usage(prompt_tokens: int, completion_tokens: int) -> dict:
        return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                "total_tokens": prompt_tokens + completion_tokens}

    def token_text(ae: AsyncEngine, token_id: int) -> str:
        tok = ae.engine.tokenizer
        return tok.decode([token_id]) if tok is not None else str(token_id)

    def top_dict(ae: AsyncEngine, top: list[tuple[int, float]]) -> dict[str, float]:
        """The legacy format keys alternatives by text. Two ids can decode to the same text
        (e.g. byte tokens that each render as U+FFFD); keep the first, i.e. the most likely,
        instead of letting a later, less likely one overwrite it."""
        out: dict[str, float] = {}
        for t, v in top:
            out.setdefault(token_text(ae, t), v)
        return out

    def completion_logprobs(ae: AsyncEngine, token_ids: list[int], lps, offset: int) -> dict:
        tokens = [token_text(ae, t) for t in token_ids]
        offsets, pos = [], offset
        for t in tokens:
            offsets.append(pos)
            pos += len(t)
        return {"tokens": tokens, "token_logprobs": [lp.token_logprob for lp in lps],
                "top_logprobs": [top_dict(ae, lp.top) for lp in lps], "text_offset": offsets}

    def chat_logprobs(ae: AsyncEngine, token_ids: list[int], lps) -> dict:
        def entry(t: int, v: float) -> dict:
            s = token_text(ae, t)
            return {"token": s, "logprob": v, "bytes": list(s.encode("utf-8"))}

        return {"content": [{**entry(t, lp.token_logprob), "top_logprobs": [entry(tt, v) for tt, v in lp.top]}
                            for t, lp in zip(token_ids, lps, strict=True)]}

    class Timing:
        """Latency bookkeeping of one HTTP request: one clock per engine request (prompt),
        one last-token time per sequence, so TTFT and e2e are observed once per prompt
        and inter-token gaps per sequence, whatever n and the number of prompts."""

        def __init__(self) -> None:
            self.start = time.monotonic()
            self.first: set[int] = set()
            self.last: dict[tuple[int, int], float] = {}

        def observe(self, i: int, out: RequestOutput) -> None:
            now = time.monotonic()
            for c in out.outputs:
                if not c.token_ids:
                    continue
                if i not in self.first:
                    self.first.add(i)
                    metrics.ttft.observe(now - self.start)
                last = self.last.get((i, c.index))
                if last is not None:
                    gap = (now - last) / len(c.token_ids)
                    for _ in c.token_ids:
                        metrics.itl.observe(gap)
                self.last[(i, c.index)] = now
            if out.finished:
                metrics.e2e.observe(now - self.start)
                if out.metrics is not None and out.metrics.queue_time is not None:
                    metrics.queue_time.observe(max(out.metrics.queue_time, 0.0))

    async def generate_choices(ae: AsyncEngine, prefix: str, jobs, n: int, cache_salt: str | None):
        """Collect a non-streaming response: text, tokens and logprobs per choice."""
        choices = {}
        timing = Timing()
        async for i, out in run_all(ae, prefix, jobs, cache_salt):
            timing.observe(i, out)
            for c in out.outputs:
                ch = choices.setdefault(i * n + c.index, {"text": "", "ids": [], "lps": [], "finish": None})
                ch["text"] += c.text
                ch["ids"] += c.token_ids
                if c.logprobs:
                    ch["lps"] += c.logprobs
                if c.finish_reason:
                    ch["finish"] = "stop" if c.finish_reason == "abort" else c.finish_reason
        return [choices[k] for k in sorted(choices)]

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, raw: Request):
        ae = ready_engine()
        check_model(body.model)
        jobs = prepare(ae, body.prompts(), lambda _: body.to_sampling_params(default_max=16))
        rid, created = ae.new_request_id("cmpl"), int(time.time())
        n = body.n
        prompt_tokens = sum(len(ids) for ids, _ in jobs)
        want_lp = body.logprobs is not None
        if body.stream:
            return await stream_response(raw, ae, rid, created, jobs, n, prompt_tokens, body, chat=False)
        try:
            result = await watch_disconnect(raw, generate_choices(ae, "cmpl", jobs, n, body.cache_salt))
        except (QueueFullError, EngineDeadError) as e:
            raise engine_errors(e) from None
        if isinstance(result, Response):
            return result
        choices = [{"index": k, "text": ch["text"], "finish_reason": ch["finish"],
                    "logprobs": completion_logprobs(ae, ch["ids"], ch["lps"], 0) if want_lp else None}
                   for k, ch in enumerate(result)]
        return {"id": rid, "object": "text_completion", "created": created, "model": model_name,
                "choices": choices, "usage": usage(prompt_tokens, sum(len(c["ids"]) for c in result))}

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, raw: Request):
        ae = ready_engine()
        check_model(body.model)
        messages = [{"role": m.role, "content": m.text()} for m in body.messages]
        text = render_chat(ae.engine.tokenizer, messages, body.add_generation_prompt)
        limit = ae.engine.core.max_model_len
        jobs = prepare(ae, [text], lambda plen: body.to_sampling_params(default_max=max(limit - plen, 1)),
                       add_special_tokens=False)
        rid, created = ae.new_request_id("chatcmpl"), int(time.time())
        prompt_tokens = len(jobs[0][0])
        if body.stream:
            return await stream_response(raw, ae, rid, created, jobs, body.n, prompt_tokens, body, chat=True)
        try:
            result = await watch_disconnect(raw, generate_choices(ae, "chatcmpl", jobs, body.n, body.cache_salt))
        except (QueueFullError, EngineDeadError) as e:
            raise engine_errors(e) from None
        if isinstance(result, Response):
            return result
        choices = [{"index": k, "message": {"role": "assistant", "content": ch["text"]},
                    "logprobs": chat_logprobs(ae, ch["ids"], ch["lps"]) if body.logprobs else None,
                    "finish_reason": ch["finish"]} for k, ch in enumerate(result)]
        return {"id": rid, "object": "chat.completion", "created": created, "model": model_name,
                "choices": choices, "usage": usage(prompt_tokens, sum(len(c["ids"]) for c in result))}

    async def stream_response(raw: Request, ae: AsyncEngine, rid: str, created: int, jobs, n: int,
                              prompt_tokens: int, body, chat: bool) -> Response:
        obj = "chat.completion.chunk" if chat else "text_completion"
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        want_lp = body.logprobs if chat else body.logprobs is not None
        timing = Timing()  # before the first token: TTFT counts the wait for it
        gen = run_all(ae, "chatcmpl" if chat else "cmpl", jobs, body.cache_salt)
        # Pull the first item before answering 200: a full queue or a dead engine
        # must still become a proper 429/503 status, not an error inside the stream.
        # Until then no response has started, so nothing notices a client that leaves
        # while its request waits in the queue: watch for that, as non-streaming does.
        async def first_item():
            try:
                return await gen.__anext__()
            except StopAsyncIteration:
                return None

        try:
            first = await watch_disconnect(raw, first_item())
        except (QueueFullError, EngineDeadError) as e:
            raise engine_errors(e) from None
        if isinstance(first, Response):  # the client left; the cancellation closed `gen`
            return first
        if first is not None:
            timing.observe(*first)

        def chunk(choices: list[dict], **extra) -> str:
            return sse({"id": rid, "object": obj, "created": created, "model": model_name, "choices": choices,
                        **extra})

        async def events() -> AsyncIterator[str]:
            completion_tokens, offsets = 0, {}
            try:
                if chat:
                    yield chunk([{"index": k, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                  "finish_reason": None} for k in range(len(jobs) * n)])
                item = first
                while item is not None:
                    i, out = item
                    choices = []
                    for c in out.outputs:
                        completion_tokens += len(c.token_ids)
                        # Tokens whose text is still held back (half a character, a
                        # possible stop string) produce no chunk until text arrives.
                        if not (c.text or c.finish_reason or (want_lp and c.logprobs)):
                            continue
                        k = i * n + c.index
                        finish = None if c.finish_reason is None else (
                            "stop" if c.finish_reason == "abort" else c.finish_reason)
                        lp = None
                        if want_lp and c.logprobs:
                            if chat:
                                lp = chat_logprobs(ae, c.token_ids, c.logprobs)
                            else:
                                lp = completion_logprobs(ae, c.token_ids, c.logprobs, offsets.get(k, 0))
                        offsets[k] = offsets.get(k, 0) + len(c.text)
                        if chat:
                            delta = {"content": c.text} if c.text else {}
                            choices.append({"index": k, "delta": delta, "logprobs": lp, "finish_reason": finish})
                        else:
                            choices.append({"index": k, "text": c.text, "logprobs": lp, "finish_reason": finish})
                    if choices:
                        yield chunk(choices)
                    item = await gen.__anext__()
                    timing.observe(*item)
            except StopAsyncIteration:
                pass
            except (QueueFullError, EngineDeadError) as e:
                yield sse(error_body(str(e), "service_unavailable"))
            except ValueError as e:  # a later prompt of a batch the engine refused
                yield sse(error_body(str(e), param=_param_of(str(e))))
            except Exception as e:  # noqa: BLE001 - the status line is sent; end the stream in-band
                logger.exception("stream failed")
                yield sse(error_body(f"internal error: {type(e).__name__}", "server_error"))
            finally:
                await gen.aclose()
            if include_usage:
                yield chunk([], usage=usage(prompt_tokens, completion_tokens))
            yield sse("[DONE]")

        return StreamingResponse(events(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    return app


def serve(engine_factory: Callable[[], LLMEngine], model_name: str, host: str, port: int,
          max_queue: int | None = None, shutdown_timeout: float = 30.0, log_level: str = "info") -> int:
    """Run the server until SIGINT/SIGTERM. SIGTERM drains: /health turns 503, new
    requests are refused, in-flight ones finish (up to `shutdown_timeout` s), then
    the process exits 0. A model that fails to load exits 1."""
    import threading

    import uvicorn

    failure: list[BaseException] = []
    app = build_app(engine_factory, model_name, max_queue, on_load_failure=lambda e: failure.append(e))
    state: ServerState = app.state.server

    class DrainingServer(uvicorn.Server):
        draining_since: float | None = None

        def handle_exit(self, sig, frame) -> None:
            if self.draining_since is not None:  # second signal: stop now
                return super().handle_exit(sig, frame)
            self.draining_since = time.monotonic()
            state.draining = True
            logger.info("signal %s: draining %d in-flight requests (up to %.0fs)", sig,
                        state.engine.num_in_flight if state.engine else 0, shutdown_timeout)
            threading.Thread(target=self._wait_drained, daemon=True).start()

        def _wait_drained(self) -> None:
            deadline = self.draining_since + shutdown_timeout
            while time.monotonic() < deadline and state.engine is not None and state.engine.num_in_flight:
                time.sleep(0.05)
            self.should_exit = True

    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=5,
                            access_log=False)
    server = DrainingServer(config)

    def watch_failure() -> None:
        while not server.should_exit:
            if failure:
                server.should_exit = True
                return
            time.sleep(0.1)

    threading.Thread(target=watch_failure, daemon=True).start()
    server.run()
    return 1 if failure else 0
