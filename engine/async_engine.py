"""Async front of one engine: the step loop runs in its own thread.

The event loop (HTTP handlers) never blocks on the model. Handlers put
commands (add, abort) on a thread-safe queue; the engine thread applies them
between steps, runs steps while there is work, and hands each request's
outputs back to its own asyncio queue with `call_soon_threadsafe`. An idle
connection is just an awaiting coroutine: it costs nothing in the step loop.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from pagefleet.engine.llm_engine import LLMEngine
from pagefleet.engine.outputs import RequestOutput
from pagefleet.engine.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The step loop crashed; the replica must be restarted (health reports 503)."""


class QueueFullError(RuntimeError):
    """More requests are waiting than --max-queue allows; the client should retry later."""


@dataclass
class ServingCounters:
    """Request-level counters kept on the event-loop side (exported as metrics)."""
    prompt_tokens: int = 0
    generation_tokens: int = 0
    requests_finished: dict[str, int] = field(default_factory=dict)  # by finish reason


class AsyncEngine:
    def __init__(self, engine: LLMEngine, max_queue: int | None = None) -> None:
        self.engine = engine
        self.max_queue = max_queue
        self.error: BaseException | None = None
        self.counters = ServingCounters()
        self._commands: queue.SimpleQueue[tuple] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._streams: dict[str, asyncio.Queue] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stop = False
        self._next_id = 0

    # ---- lifecycle ---------------------------------------------------------------------

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="engine-step-loop", daemon=True)
        self._thread.start()

    def shutdown(self) -> None:
        """Stop the step loop. Call from the event loop's thread: requests still in
        flight get an EngineDeadError instead of waiting forever for their next output."""
        self._stop = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
        for stream in self._streams.values():
            stream.put_nowait(EngineDeadError("engine shut down"))

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self.error is None

    @property
    def num_in_flight(self) -> int:
        return len(self._streams)

    def num_waiting(self) -> int:
        return len(self.engine.core.scheduler.waiting) + self._commands.qsize()

    # ---- requests ----------------------------------------------------------------------

    def new_request_id(self, prefix: str) -> str:
        self._next_id += 1
        return f"{prefix}-{self._next_id}-{time.monotonic_ns() % 10**9}"

    async def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                       cache_salt: str | None = None) -> AsyncIterator[RequestOutput]:
        """Stream the request's delta outputs. Leaving the iteration early (client
        disconnect, cancellation) aborts the request and frees its blocks."""
        if self.error is not None or not self.is_running:
            raise EngineDeadError("engine is not running")
        if self.max_queue is not None and self.num_waiting() >= self.max_queue:
            raise QueueFullError(f"{self.num_waiting()} requests are waiting (max_queue={self.max_queue})")
        assert self._loop is not None
        stream: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = stream
        self._commands.put(("add", request_id, prompt_token_ids, params, cache_salt))
        self._wake.set()
        finished = False
        try:
            while True:
                item = await stream.get()
                if isinstance(item, BaseException):
                    raise item
                if item.finished:
                    finished = True
                    self._count_finished(item)
                yield item
                if finished:
                    return
        finally:
            self._streams.pop(request_id, None)
            if not finished:
                self._commands.put(("abort", request_id))
                self._wake.set()

    def _count_finished(self, out: RequestOutput) -> None:
        c = self.counters
        c.prompt_tokens += len(out.prompt_token_ids)
        for comp in out.outputs:
            reason = comp.finish_reason or "abort"
            c.requests_finished[reason] = c.requests_finished.get(reason, 0) + 1

    # ---- engine thread -----------------------------------------------------------------

    def _run(self) -> None:
        try:
            while not self._stop:
                self._apply_commands()
                if not self.engine.has_unfinished():
                    self._wake.wait(timeout=0.5)
                    self._wake.clear()
                    continue
                outputs = self.engine.step()
                if outputs:
                    self._loop.call_soon_threadsafe(self._deliver, outputs)
        except BaseException as e:  # noqa: BLE001 - any crash must reach every waiting client
            logger.exception("engine step loop crashed")
            self.error = e
            self._loop.call_soon_threadsafe(self._fail_all, e)

    def _apply_commands(self) -> None:
        while True:
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return
            if cmd[0] == "add":
                _, rid, ids, params, salt = cmd
                if rid not in self._streams:
                    continue  # the client left before the engine saw the request
                try:
                    self.engine.add_request(rid, ids, params, stream=True, cache_salt=salt)
                except Exception as e:  # noqa: BLE001 - one bad request must not kill the step loop
                    if not isinstance(e, ValueError):  # ValueErrors come before any state is kept
                        logger.exception("request %s could not be added", rid)
                        self.engine.abort(rid)  # drop whatever part of it was registered (ids are unique)
                    self._loop.call_soon_threadsafe(self._deliver_error, rid, e)
            else:
                self.engine.abort(cmd[1])

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            self.counters.generation_tokens += sum(len(c.token_ids) for c in out.outputs)
            stream = self._streams.get(out.request_id)
            if stream is not None:
                stream.put_nowait(out)

    def _deliver_error(self, request_id: str, error: BaseException) -> None:
        stream = self._streams.get(request_id)
        if stream is not None:
            stream.put_nowait(error)

    def _fail_all(self, error: BaseException) -> None:
        for stream in self._streams.values():
            stream.put_nowait(EngineDeadError(f"engine step loop crashed: {error!r}"))
