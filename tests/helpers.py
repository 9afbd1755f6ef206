"""Shared test helpers: live uvicorn servers, SSE parsing, error-shape checks."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import uvicorn
from fastapi import FastAPI
from fastapi.responses import PlainTextResponse, StreamingResponse
from prometheus_client.parser import text_string_to_metric_families


def wait_until(predicate: Callable[[], object], timeout: float, what: str, interval: float = 0.05):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)


class LiveServer:
    """uvicorn in a background thread on a socket bound before start (no port race).
    Signal handlers are not installed off the main thread; `stop()` ends it."""

    def __init__(self, app, model: str = "tiny") -> None:
        self.app, self.model = app, model
        # proto=IPPROTO_TCP: asyncio only sets TCP_NODELAY on accepted sockets of a TCP-proto listener,
        # and Nagle + delayed ACK would add 40 ms to every multi-write response.
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=2)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True,
                                       name=f"uvicorn-{self.port}")
        self.http = httpx.Client(base_url=self.url, timeout=30)

    def start(self, ready: bool = True, timeout: float = 120) -> LiveServer:
        self.thread.start()
        try:
            wait_until(lambda: self.server.started or not self.thread.is_alive(), 30, "uvicorn to start")
            assert self.server.started, "uvicorn failed to start"
            if ready:
                self.wait_healthy(timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def wait_healthy(self, timeout: float = 120) -> None:
        wait_until(lambda: self.http.get("/health").status_code == 200, timeout, "/health to return 200",
                   interval=0.1)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)
        self.http.close()
        self.sock.close()
        assert not self.thread.is_alive(), "server thread did not stop"

    # ---- small helpers ---------------------------------------------------------------

    def metrics(self) -> dict[tuple[str, tuple], float]:
        """Samples of /metrics as {(name, sorted labels): value}."""
        r = self.http.get("/metrics")
        assert r.status_code == 200
        out = {}
        for fam in text_string_to_metric_families(r.text):
            for s in fam.samples:
                out[(s.name, tuple(sorted(s.labels.items())))] = s.value
        return out

    def completion(self, **body) -> httpx.Response:
        return self.http.post("/v1/completions", json={"model": self.model, **body})



def sse_events(lines: Iterator[str]) -> Iterator[dict | str]:
    """Parse `data: ...` lines of an SSE stream into JSON objects ('[DONE]' stays a string)."""
    for line in lines:
        if not line.startswith("data: "):
            assert line == "", f"unexpected SSE line {line!r}"
            continue
        data = line[len("data: "):]
        yield data if data == "[DONE]" else json.loads(data)


def raw_post(port: int, path: str, body: dict) -> socket.socket:
    """Send a request over a bare socket, without reading the answer: closing the socket is
    a client that goes away at an exact moment."""
    data = json.dumps(body).encode()
    sock = socket.create_connection(("127.0.0.1", port), timeout=30)
    sock.sendall(f"POST {path} HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
    return sock


def assert_error(r: httpx.Response, status: int, param: str | None = None, code: str | None = None,
                 err_type: str | None = None) -> dict:
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error"}, body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert isinstance(err["message"], str) and err["message"]
    assert isinstance(err["type"], str) and err["type"]
    if param is not None:
        assert err["param"] == param, err
    if code is not None:
        assert err["code"] == code, err
    if err_type is not None:
        assert err["type"] == err_type, err
    return err


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Proc:
    """A `pagefleet` CLI subcommand in a subprocess, logging to a file."""

    def __init__(self, args: list[str], log_path, port: int) -> None:
        exe = Path(sys.executable).with_name("pagefleet")
        self.port, self.url, self.log_path = port, f"http://127.0.0.1:{port}", log_path
        self._log = open(log_path, "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen([str(exe), *args, "--port", str(port)], stdout=self._log,
                                     stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})

    def log(self) -> str:
        return open(self.log_path, errors="replace").read()

    def healthy(self) -> bool:
        try:
            return httpx.get(f"{self.url}/health", timeout=5).status_code == 200
        except httpx.TransportError:
            return False

    def wait_healthy(self, timeout: float = 120) -> None:
        wait_until(lambda: self.healthy() or self.proc.poll() is not None, timeout, f"{self.url} to be healthy",
                   interval=0.2)
        assert self.proc.poll() is None, self.log()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=30)
        self._log.close()


def spawn_engine(model_dir, log_path, model: str = "tiny", *extra: str) -> Proc:
    return Proc(["engine", "--model", str(model_dir), "--served-model-name", model, "--kv-cache-memory", "16MiB",
                 "--max-model-len", "512", "--dtype", "float32", "--threads", "1", *extra], log_path, free_port())


def scripted_upstream(chunks: list[bytes], gap: float = 0.0, status: int = 200,
                      gate: threading.Event | None = None, closed: threading.Event | None = None) -> FastAPI:
    """A fake engine replica: ready, idle, and answering /v1/completions with `chunks`
    (`gap` seconds apart; after the first chunk it waits for `gate` if given). `closed`
    is set when the response generator ends for any reason (e.g. the client left)."""
    app = FastAPI()

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(
            'pagefleet:num_requests_running{model_name="m"} 0\npagefleet:num_requests_waiting{model_name="m"} 0\n'
            'pagefleet:kv_cache_usage_perc{model_name="m"} 0\n'
            'pagefleet:cache_config_info{block_size="16",model_name="m",num_blocks="10"} 1\n')

    @app.post("/v1/completions")
    async def completions():
        async def gen():
            try:
                for i, c in enumerate(chunks):
                    yield c
                    if i == 0 and gate is not None:
                        await asyncio.to_thread(gate.wait, 30)
                    await asyncio.sleep(gap)
            finally:
                if closed is not None:
                    closed.set()
        return StreamingResponse(gen(), status_code=status, media_type="text/event-stream")

    return app
