"""Serving vs offline: the same workload through HTTP and through `LLM.generate`.

Measures what the HTTP server costs. Our engine is started as a real
`pagefleet engine` process; an async client streams the offline throughput
benchmark's workload (64 requests, prompts 32-512 tokens, outputs 32-256,
ignore_eos, greedy) at a fixed concurrency and records, per request, time to
first token and the gaps between streamed tokens. The offline reference runs
the same workload in-process, once with the default scheduler limits and once
capped at the HTTP concurrency (`max_num_seqs`), since a batch of 16 and a
batch of 64 are different amounts of work per step on a CPU.

Usage:
    .venv/bin/python bench/serving.py                  # the recorded configuration
    .venv/bin/python bench/serving.py --num-requests 8 --hidden-size 64 --num-layers 2 \
        --num-heads 4 --num-kv-heads 2 --intermediate-size 128 --vocab-size 512   # a smoke run
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import offline_throughput as ot  # noqa: E402  (shared workload, checkpoint and machine info)

ROOT = Path(__file__).resolve().parent.parent
MODEL_NAME = "bench"


def percentiles(xs: list[float]) -> dict[str, float]:
    if not xs:
        return {}
    s = sorted(xs)

    def pct(p: float) -> float:
        return s[min(len(s) - 1, round(p / 100 * (len(s) - 1)))]

    return {"mean": statistics.fmean(s), "p50": pct(50), "p90": pct(90), "p99": pct(99)}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make_llm(model: Path, args, max_num_seqs: int):
    from pagefleet.engine import LLM

    return LLM(model=str(model), dtype=args.dtype, kv_cache_memory=args.kv_budget, max_num_seqs=max_num_seqs,
               max_num_batched_tokens=args.max_batch_tokens)


def run_offline(llm, workload: ot.Workload) -> dict:
    from pagefleet.engine import SamplingParams

    warm = ot.warmup_workload(workload)
    llm.generate(warm.prompts, [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in warm.output_lens])
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in workload.output_lens]
    start = time.perf_counter()
    outs = llm.generate(workload.prompts, params)
    wall = time.perf_counter() - start
    generated = sum(len(o.outputs[0].token_ids) for o in outs)
    ttft = [o.metrics.time_to_first_token for o in outs]
    return {"wall_s": wall, "generated_tokens": generated, "tokens_per_s": generated / wall,
            "ttft_s": percentiles(ttft)}


async def one_request(client: httpx.AsyncClient, prompt: list[int], max_tokens: int) -> dict:
    # logprobs=0 makes every generated token visible as a chunk even when its text is
    # empty (the benchmark model's vocabulary is larger than its tokenizer's, so many
    # ids decode to ""; the server sends no chunk for tokens with no text otherwise).
    body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}, "logprobs": 0}
    start = time.perf_counter()
    stamps: list[float] = []
    usage = None
    async with client.stream("POST", "/v1/completions", json=body) as resp:
        if resp.status_code != 200:
            raise RuntimeError(f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}")
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                usage = chunk["usage"]
            if chunk["choices"]:
                lp = chunk["choices"][0].get("logprobs") or {}
                now = time.perf_counter()
                stamps.extend([now] * len(lp.get("tokens") or []))  # one stamp per token in the chunk
    end = time.perf_counter()
    completion = usage["completion_tokens"] if usage else 0
    assert len(stamps) == completion, f"saw {len(stamps)} tokens in the stream, usage says {completion}"
    return {"ttft": (stamps[0] if stamps else end) - start, "e2e": end - start, "completion_tokens": completion,
            "itl": [b - a for a, b in zip(stamps, stamps[1:], strict=False)]}


async def run_http(base_url: str, workload: ot.Workload, concurrency: int) -> dict:
    sem = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=base_url, timeout=None, limits=limits) as client:
        await one_request(client, workload.prompts[0][:16], 4)  # warm-up: connection, lazy init

        async def bounded(p: list[int], n: int) -> dict:
            async with sem:
                return await one_request(client, p, n)

        start = time.perf_counter()
        results = await asyncio.gather(*(bounded(p, n) for p, n in zip(workload.prompts, workload.output_lens,
                                                                          strict=True)))
        wall = time.perf_counter() - start
    generated = sum(r["completion_tokens"] for r in results)
    return {"wall_s": wall, "generated_tokens": generated, "tokens_per_s": generated / wall,
            "ttft_s": percentiles([r["ttft"] for r in results]),
            "itl_s": percentiles([x for r in results for x in r["itl"]]),
            "e2e_s": percentiles([r["e2e"] for r in results])}


def start_server(model: Path, port: int, args) -> subprocess.Popen:
    cmd = [str(ROOT / ".venv/bin/pagefleet"), "engine", "--model", str(model), "--served-model-name", MODEL_NAME,
           "--port", str(port), "--dtype", args.dtype, "--kv-cache-memory", args.kv_budget,
           "--max-num-batched-tokens", str(args.max_batch_tokens), "--threads", str(args.threads)]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    wait_healthy(proc, f"http://127.0.0.1:{port}", "server")
    return proc


def wait_healthy(proc: subprocess.Popen, url: str, what: str, timeout: float = 300) -> None:
    """Poll `url`/health until 200; kill the process and raise if it exits or times out."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited: {proc.stderr.read()[-2000:]}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    proc.kill()
    raise RuntimeError(f"{what} did not become healthy in {timeout} s")


def fmt(d: dict, key: str) -> str:
    return f"{d[key] * 1e3:.0f}" if d and key in d else "-"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--min-prompt", type=int, default=32)
    p.add_argument("--max-prompt", type=int, default=512)
    p.add_argument("--min-output", type=int, default=32)
    p.add_argument("--max-output", type=int, default=256)
    p.add_argument("--concurrency", type=int, default=16, help="in-flight HTTP requests (default 16)")
    p.add_argument("--rounds", type=int, default=3,
                   help="interleaved offline/HTTP rounds at that concurrency, each on a fresh workload seed "
                        "(default 3; the median ratio is reported)")
    p.add_argument("--threads", type=int, default=2, help="torch threads for the engine (default 2)")
    p.add_argument("--kv-budget", default="2GiB")
    p.add_argument("--max-batch-tokens", type=int, default=2048)
    p.add_argument("--seed", type=int, default=0)
    ot.add_model_args(p)
    p.add_argument("--result-json", default=str(ROOT / "bench/results/serving.json"))
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)

    model = ot.ensure_checkpoint(args)
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model)

    def workload_for(round_: int) -> ot.Workload:
        # A fresh seed per round: repeating identical prompts would hit the prefix cache.
        return ot.make_workload(args.num_requests, (args.min_prompt, args.max_prompt),
                                (args.min_output, args.max_output), config.vocab_size,
                                ot.special_token_ids(model, config), args.seed + round_)

    print("offline, default limits ...", file=sys.stderr)
    llm = make_llm(model, args, max_num_seqs=256)
    offline = run_offline(llm, workload_for(0))
    del llm
    capped = make_llm(model, args, max_num_seqs=args.concurrency)
    port = free_port()
    server = start_server(model, port, args)
    rounds = []
    try:
        for r in range(args.rounds):
            workload = workload_for(r)
            runs = {}
            # Alternate the order so drift in machine speed hits both sides alike.
            for what in (("offline", "http") if r % 2 == 0 else ("http", "offline")):
                print(f"round {r}: {what} ...", file=sys.stderr)
                if what == "offline":
                    runs[what] = run_offline(capped, workload)
                else:
                    runs[what] = asyncio.run(run_http(f"http://127.0.0.1:{port}", workload, args.concurrency))
            assert runs["http"]["generated_tokens"] == runs["offline"]["generated_tokens"] == workload.num_output_tokens
            rounds.append({"offline_capped": runs["offline"], "http": runs["http"],
                           "ratio": runs["http"]["tokens_per_s"] / runs["offline"]["tokens_per_s"]})
    finally:
        server.send_signal(signal.SIGTERM)
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            server.kill()

    ratio = statistics.median(r["ratio"] for r in rounds)
    result = {
        "command": " ".join(shlex.quote(a) for a in [".venv/bin/python", "bench/serving.py", *(argv or sys.argv[1:])]),
        "machine": ot.machine_info(args.threads), "model": str(model), "concurrency": args.concurrency,
        "num_requests": args.num_requests, "rounds": rounds, "offline_uncapped_round0": offline,
        "median_ratio_http_vs_offline_capped": ratio,
        "ratio_http_vs_offline_uncapped_round0": rounds[0]["http"]["tokens_per_s"] / offline["tokens_per_s"],
    }
    Path(args.result_json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.result_json).write_text(json.dumps(result, indent=2))

    print("| round | run | gen tokens | wall s | tok/s | TTFT p50 / p90 / p99 ms | ITL p50 / p90 / p99 ms |")
    print("|---|---|---|---|---|---|---|")
    rows = [(0, "offline `LLM.generate` (max_num_seqs 256)", offline)]
    for r, rd in enumerate(rounds):
        rows += [(r, f"offline `LLM.generate` (max_num_seqs {args.concurrency})", rd["offline_capped"]),
                 (r, f"HTTP `pagefleet engine`, concurrency {args.concurrency}", rd["http"])]
    for r, name, run in rows:
        ttft, itl = run["ttft_s"], run.get("itl_s", {})
        print(f"| {r} | {name} | {run['generated_tokens']} | {run['wall_s']:.1f} | {run['tokens_per_s']:.1f} | "
              f"{fmt(ttft, 'p50')} / {fmt(ttft, 'p90')} / {fmt(ttft, 'p99')} | "
              f"{fmt(itl, 'p50')} / {fmt(itl, 'p90')} / {fmt(itl, 'p99')} |")
    per_round = ", ".join(f"{rd['ratio']:.2f}" for rd in rounds)
    print(f"\nHTTP / offline at the same concurrency, per round: {per_round}; "
          f"median {ratio:.2f}x. HTTP / offline with all requests batched (round 0): "
          f"{result['ratio_http_vs_offline_uncapped_round0']:.2f}x")
    print(f"machine: {result['machine']['cpu_model']}, {args.threads} threads, torch {torch.__version__}; "
          f"loadavg {os.getloadavg()[0]:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
