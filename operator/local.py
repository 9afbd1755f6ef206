"""`pagefleet up`: an InferenceService on one machine, as local processes.

The same YAML the operator reconciles: engine replicas (`pagefleet engine`)
and a router (`pagefleet router`) started through the CLI on free ports, the
pool scaled between minReplicas and maxReplicas by the operator's own policy
(`autoscale.decide`) fed from the engines' /metrics. The router learns the
replica set from an endpoints file this process rewrites (atomically) as
replicas become ready or are drained, the local stand-in for EndpointSlices.

Children die with this process (PR_SET_PDEATHSIG), a crashed engine is
replaced like a Deployment would, and a crashed router ends the fleet.
"""

from __future__ import annotations

import ctypes
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from pagefleet.operator.autoscale import Recommendation, decide, parse_pod_metrics
from pagefleet.operator.render import engine_args, router_args
from pagefleet.operator.spec import InferenceService, unsupported_features

logger = logging.getLogger("pagefleet.up")


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _die_with_parent() -> None:
    """In the child before exec: SIGTERM when the parent goes, so a killed `up` leaves no orphans."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


@dataclass
class Child:
    role: str
    proc: subprocess.Popen
    url: str
    ready: bool = False
    draining: bool = False
    started: float = field(default_factory=time.monotonic)


class LocalFleet:
    def __init__(self, isvc: InferenceService, *, host: str = "127.0.0.1", port: int = 8080,
                 replicas: int | None = None, tick_seconds: float = 2.0, log_dir: Path | None = None) -> None:
        spec = isvc.spec
        problems = unsupported_features(spec)
        if problems:
            raise ValueError("not supported by this version yet: " + "; ".join(problems))
        if len(spec.pools) != 1:
            raise ValueError("pagefleet up runs InferenceServices with one pool for now "
                             f"(this one has {len(spec.pools)})")
        self.isvc, self.spec, self.pool = isvc, spec, spec.pools[0]
        self.served = isvc.served_name()
        self.host, self.port, self.tick = host, port, tick_seconds
        auto = self.pool.autoscaling
        self.params = auto.params()
        self.fixed = replicas  # --replicas: no autoscaling
        if replicas is not None and replicas < 1:
            raise ValueError("--replicas must be >= 1")
        self.exe = str(Path(sys.executable).with_name("pagefleet"))
        self.workdir = Path(tempfile.mkdtemp(prefix="pagefleet-up-"))
        self.log_dir = log_dir or self.workdir
        self.endpoints_file = self.workdir / "endpoints.json"
        self.engines: list[Child] = []
        self.router: Child | None = None
        self.history: tuple[Recommendation, ...] = ()
        self.stopping = threading.Event()
        self._n = 0

    # ---- children ------------------------------------------------------------------------------

    def _spawn(self, role: str, args: list[str], url: str) -> Child:
        self._n += 1
        log = open(self.log_dir / f"{role}-{self._n}.log", "wb")  # noqa: SIM115 - owned by the child
        proc = subprocess.Popen([self.exe, *args], stdout=log, stderr=subprocess.STDOUT,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"}, preexec_fn=_die_with_parent)
        log.close()
        return Child(role, proc, url)

    def _start_engine(self) -> Child:
        port = _free_port(self.host)
        child = self._spawn("engine", engine_args(self.spec, self.served, self.host, port),
                            f"http://{self.host}:{port}")
        self.engines.append(child)
        logger.info("starting engine %s (pid %d)", child.url, child.proc.pid)
        return child

    def _write_endpoints(self) -> None:
        urls = sorted(c.url for c in self.engines if c.ready and not c.draining)
        tmp = self.endpoints_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(urls))
        os.replace(tmp, self.endpoints_file)  # the router never reads half a file

    def _healthy(self, child: Child) -> bool:
        try:
            return httpx.get(f"{child.url}/health", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    def _drain(self, child: Child) -> None:
        """Out of the router first, then SIGTERM: the engine finishes what it has and exits."""
        child.draining = True
        self._write_endpoints()
        logger.info("draining engine %s", child.url)
        child.proc.send_signal(signal.SIGTERM)

    # ---- lifecycle ---------------------------------------------------------------------------------

    def start(self, timeout: float = 900) -> None:
        if self.spec.model.uri.startswith("pagefleet://"):
            # Pull once here (with its progress bars) instead of in every replica.
            name = self.spec.model.uri.removeprefix("pagefleet://")
            if subprocess.run([self.exe, "models", "pull", name]).returncode != 0:
                raise RuntimeError(f"could not pull {name}")
        want = self.fixed or max(self.params.min_replicas, 1)
        for _ in range(want):
            self._start_engine()
        deadline = time.monotonic() + timeout
        while not all(c.ready for c in self.engines):
            self._check_children()
            for c in self.engines:
                c.ready = c.ready or self._healthy(c)
            if time.monotonic() > deadline:
                raise RuntimeError(f"engines not ready after {timeout:.0f}s; see logs in {self.log_dir}")
            time.sleep(0.3)
        self._write_endpoints()
        self.router = self._spawn("router", router_args(
            self.spec, self.served, self.pool.name, ["--endpoints-file", f"{self.pool.name}={self.endpoints_file}"],
            self.host, self.port), f"http://{self.host}:{self.port}")
        while not self._healthy(self.router):
            if self.router.proc.poll() is not None:
                raise RuntimeError(f"the router exited; see {self.log_dir}")
            if time.monotonic() > deadline:
                raise RuntimeError("the router did not become healthy")
            time.sleep(0.2)
        self.router.ready = True

    def banner(self) -> str:
        url = self.router.url if self.router else "?"
        return f"""
pagefleet up: {self.isvc.metadata.name} serving `{self.served}` at {url}/v1  ({len(self.engines)} engine \
replica(s), autoscaling {self.params.min_replicas}..{self.params.max_replicas}; logs in {self.log_dir})

  curl -s {url}/v1/chat/completions -H 'content-type: application/json' -d '{{
    "model": "{self.served}", "messages": [{{"role": "user", "content": "Write hello world in Python."}}]}}'

  from openai import OpenAI
  client = OpenAI(base_url="{url}/v1", api_key="unused")
  print(client.chat.completions.create(model="{self.served}",
        messages=[{{"role": "user", "content": "Write hello world in Python."}}]).choices[0].message.content)

Ctrl-C stops everything.
"""

    def _check_children(self) -> None:
        if self.router is not None and self.router.proc.poll() is not None:
            raise RuntimeError(f"the router exited with code {self.router.proc.returncode}; see {self.log_dir}")
        for c in list(self.engines):
            code = c.proc.poll()
            if code is None:
                continue
            self.engines.remove(c)
            if c.draining:
                logger.info("engine %s drained and stopped", c.url)
            else:
                logger.warning("engine %s exited with code %s; starting a replacement", c.url, code)
                self._write_endpoints()
                self._start_engine()

    def step(self, now: float) -> None:
        """One tick: reap, promote ready engines, then scale by the policy."""
        self._check_children()
        changed = False
        for c in self.engines:
            if not c.ready and not c.draining and self._healthy(c):
                c.ready, changed = True, True
                logger.info("engine %s ready", c.url)
        if changed:
            self._write_endpoints()
        if self.fixed is not None:
            return
        live = [c for c in self.engines if not c.draining]
        pods = []
        for c in live:
            if not c.ready:
                continue
            try:
                m = parse_pod_metrics(httpx.get(f"{c.url}/metrics", timeout=2).text)
            except httpx.HTTPError:
                m = None
            if m is not None:
                pods.append(m)
        d = decide(self.params, len(live), pods or None, self.history, now)
        self.history = d.history
        if d.replicas > len(live):
            logger.info("autoscale: %s", d.reason)
            for _ in range(d.replicas - len(live)):
                self._start_engine()
        elif d.replicas < len(live):
            logger.info("autoscale: %s", d.reason)
            # newest first, and never one that is still starting while a ready one could go
            victims = sorted(live, key=lambda c: (c.ready, c.started), reverse=True)[: len(live) - d.replicas]
            for c in victims:
                self._drain(c)

    def serve(self) -> None:
        while not self.stopping.wait(self.tick):
            self.step(time.monotonic())

    def stop(self, timeout: float | None = None) -> None:
        timeout = timeout if timeout is not None else self.spec.engine.shutdown_timeout_seconds + 5
        children = [c for c in [self.router, *self.engines] if c is not None]
        for c in children:
            if c.proc.poll() is None:
                c.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout
        for c in children:
            try:
                c.proc.wait(timeout=max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                logger.warning("%s %s did not stop in time; killing it", c.role, c.url)
                c.proc.kill()
                c.proc.wait()


def load_file(path: str | Path) -> InferenceService:
    import yaml

    p = Path(path)
    if not p.is_file():
        raise ValueError(f"{path}: no such file (pass an InferenceService YAML, e.g. examples/quickstart.yaml)")
    docs = [d for d in yaml.safe_load_all(p.read_text()) if d]
    found = [d for d in docs if isinstance(d, dict) and d.get("kind") == "InferenceService"]
    if len(found) != 1:
        raise ValueError(f"{path}: expected one InferenceService, found {len(found)}")
    from pydantic import ValidationError

    try:
        return InferenceService.model_validate(found[0])
    except ValidationError as e:
        raise ValueError(f"{path}: invalid InferenceService:\n{e}") from None


def run(path: str, host: str, port: int, replicas: int | None, tick_seconds: float = 2.0) -> int:
    fleet = LocalFleet(load_file(path), host=host, port=port, replicas=replicas, tick_seconds=tick_seconds)

    def on_signal(signum, frame) -> None:
        fleet.stopping.set()

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    code = 0
    try:
        fleet.start()
        print(fleet.banner(), flush=True)
        fleet.serve()
        logger.info("stopping")
    except RuntimeError as e:
        logger.error("%s", e)
        code = 1
    finally:
        fleet.stop()
    return code
