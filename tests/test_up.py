"""`pagefleet up` as a user runs it: a subprocess reading an InferenceService YAML,
starting engines and a router, answering through the router, scaling with the
operator's policy, and leaving no process behind."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import httpx
import openai
import pytest
from helpers import free_port, wait_until

pytestmark = pytest.mark.slow


def children(pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout
    return [int(x) for x in out.split()]


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    stat = Path(f"/proc/{pid}/stat")
    return stat.exists() and stat.read_text().split()[2] != "Z"


ENGINE = "{kvCacheMemory: 16MiB, maxModelLen: 512, dtype: float32, threads: 1}"


class Up:
    def __init__(self, tmp: Path, model: Path, *args: str, engine: str = ENGINE, **autoscaling) -> None:
        auto = {"minReplicas": 1, "maxReplicas": 2, **autoscaling}
        yaml = tmp / "isvc.yaml"
        yaml.write_text(f"""apiVersion: pagefleet.dev/v1alpha1
kind: InferenceService
metadata: {{name: tiny}}
spec:
  model: {{uri: {model}, servedName: tiny}}
  engine: {engine}
  pools:
    - name: main
      autoscaling: {{{", ".join(f"{k}: {v}" for k, v in auto.items())}}}
""")
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = tmp / "up.log"
        self.proc = subprocess.Popen([str(Path(sys.executable).with_name("pagefleet")), "up", str(yaml), "--port",
                                      str(self.port), "--tick", "0.5", *args],
                                     stdout=open(self.log_path, "wb"), stderr=subprocess.STDOUT,  # noqa: SIM115
                                     env={**os.environ, "PYTHONUNBUFFERED": "1"})

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def health(self) -> dict | None:
        try:
            r = httpx.get(f"{self.url}/health", timeout=5)
        except httpx.HTTPError:
            return None
        return r.json() if r.status_code == 200 else None

    def replicas(self) -> int:
        h = self.health()
        return h["pools"]["main"]["ready"] if h else 0

    def wait_ready(self, n: int, timeout: float = 120) -> None:
        wait_until(lambda: self.replicas() == n or self.proc.poll() is not None, timeout, f"{n} ready replicas",
                   interval=0.3)
        assert self.proc.poll() is None, self.log()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


@pytest.fixture
def tiny(tiny_qwen2: Path) -> Path:
    return tiny_qwen2


def test_up_answers_through_the_router_and_stops_cleanly_on_sigint(tiny: Path, tmp_path: Path) -> None:
    up = Up(tmp_path, tiny, "--replicas", "2")
    try:
        up.wait_ready(2)
        wait_until(lambda: "Ctrl-C stops everything" in up.log(), 10, "the banner")
        assert "pagefleet up: tiny serving `tiny`" in up.log() and "curl -s" in up.log()
        client = openai.OpenAI(base_url=f"{up.url}/v1", api_key="x")
        out = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=5)
        assert out.choices[0].finish_reason == "length" and out.usage.completion_tokens == 5
        kids = children(up.proc.pid)
        assert len(kids) == 3  # two engines and the router
        up.proc.send_signal(signal.SIGINT)
        assert up.proc.wait(60) == 0, up.log()
        assert not [k for k in kids if alive(k)], "children outlived pagefleet up"
    finally:
        up.kill()


def test_crashed_engine_is_replaced_and_a_crashed_router_stops_everything(tiny: Path, tmp_path: Path) -> None:
    up = Up(tmp_path, tiny, "--replicas", "2")
    try:
        up.wait_ready(2)
        kids = children(up.proc.pid)
        engines = [k for k in kids if b" engine " in Path(f"/proc/{k}/cmdline").read_bytes().replace(b"\0", b" ")]
        router = [k for k in kids if k not in engines]
        os.kill(engines[0], signal.SIGKILL)
        wait_until(lambda: "starting a replacement" in up.log(), 30, "the crash to be noticed")
        up.wait_ready(2)  # replaced, and the router routes to the replacement
        new = [k for k in children(up.proc.pid) if k not in kids]
        assert len(new) == 1
        os.kill(router[0], signal.SIGKILL)
        assert up.proc.wait(60) == 1, up.log()
        assert "the router exited" in up.log()
        assert not [k for k in children(up.proc.pid) + engines[1:] + new if alive(k)]
    finally:
        up.kill()


def test_local_autoscaling_adds_a_replica_under_a_burst_and_removes_it_after_the_window(tiny: Path,
                                                                                      tmp_path: Path) -> None:
    # One sequence per engine, so a burst queues; a short scale-down window to see the way back.
    up = Up(tmp_path, tiny, targetWaitingPerReplica=1, scaleDownWindowSeconds=3,
            engine="{kvCacheMemory: 16MiB, maxModelLen: 512, dtype: float32, threads: 1, maxNumSeqs: 1}")
    try:
        up.wait_ready(1)
        done: list[int] = []

        def one(i: int) -> None:
            r = httpx.post(f"{up.url}/v1/completions", timeout=120, json={
                "model": "tiny", "prompt": f"burst {i}", "max_tokens": 150, "ignore_eos": True})
            done.append(r.status_code)

        threads = [threading.Thread(target=one, args=(i,)) for i in range(6)]
        for t in threads:
            t.start()
        up.wait_ready(2, timeout=60)
        assert "autoscale: scale up 1 -> 2" in up.log()
        for t in threads:
            t.join(120)
        assert done == [200] * 6  # scaling never cost a request
        up.wait_ready(1, timeout=60)
        wait_until(lambda: "drained and stopped" in up.log(), 60, "the drained engine to exit")
        assert "autoscale: scale down 2 -> 1" in up.log()
    finally:
        up.kill()
