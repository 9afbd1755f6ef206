"""Router: prefix-aware vs round-robin over the same engine replicas, in one run.

Starts N `pagefleet engine` replicas and two `pagefleet router` processes over
them (policy `prefix` and policy `round-robin`), then sends the same kind of
multi-tenant workload through each, alternating policies round by round:

- T tenants, each with its own S-token system prompt (token ids, seeded), R
  requests in shuffled order, each the tenant's system prompt plus a short
  random question, streamed at a fixed concurrency (greedy, ignore_eos).
- Every run uses its own `cache_salt`, so no run profits from blocks an earlier
  run left in the engines' caches.

Per run it records the engines' aggregate prefix-cache hit rate (from their
/metrics counters), throughput, and TTFT percentiles. Then:

- skewed load: one tenant sends half the requests (prefix policy); reports the
  time-averaged in-flight requests of every replica against their mean;
- router overhead: the same small request sent directly to a replica and
  through the prefix router, alternating; reports the p50 added latency.

The KV cache of each replica is deliberately smaller than all tenants'
prefixes together (the case prefix-aware routing exists for); the default
model is a small random-weight Llama so the run fits a 2-core machine.

Usage:
    .venv/bin/python bench/router.py                       # the recorded configuration
    .venv/bin/python bench/router.py --num-requests 32 --rounds 1 --prefix-len 256   # a smoke run
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
import offline_throughput as ot  # noqa: E402  (checkpoint, machine and model info)
from serving import free_port, percentiles, wait_healthy  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
MODEL_NAME = "bench"
PAGEFLEET = str(ROOT / ".venv/bin/pagefleet")


# ---- processes --------------------------------------------------------------------------------------


def start(cmd: list[str]) -> tuple[subprocess.Popen, str]:
    port = free_port()
    proc = subprocess.Popen([*cmd, "--port", str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True)
    return proc, f"http://127.0.0.1:{port}"


def engine_counters(urls: list[str]) -> tuple[float, float]:
    """Summed prefix-cache (queries, hits) in tokens over the replicas."""
    from prometheus_client.parser import text_string_to_metric_families

    q = h = 0.0
    for url in urls:
        for fam in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=10).text):
            for s in fam.samples:
                if s.name == "pagefleet:prefix_cache_queries_total":
                    q += s.value
                elif s.name == "pagefleet:prefix_cache_hits_total":
                    h += s.value
    return q, h


# ---- workload -----------------------------------------------------------------------------------------


def make_requests(args, vocab: int, special: set[int], seed: int, skewed: bool) -> list[dict]:
    rng = random.Random(seed)
    ids = [t for t in range(vocab) if t not in special]
    systems = [[rng.choice(ids) for _ in range(args.prefix_len)] for _ in range(args.tenants)]
    if skewed:  # tenant 0 sends half the traffic, the others share the rest evenly
        tenants = [0] * (args.num_requests // 2)
        tenants += [1 + i % (args.tenants - 1) for i in range(args.num_requests - len(tenants))]
    else:
        tenants = [i % args.tenants for i in range(args.num_requests)]
    rng.shuffle(tenants)
    return [{"tenant": t, "prompt": systems[t] + [rng.choice(ids) for _ in range(rng.randint(16, 48))]}
            for t in tenants]


async def one(client: httpx.AsyncClient, url: str, req: dict, salt: str, max_tokens: int, t0: float) -> dict:
    body = {"model": MODEL_NAME, "prompt": req["prompt"], "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True, "logprobs": 0, "cache_salt": salt}
    start = time.perf_counter()
    ttft = None
    async with client.stream("POST", f"{url}/v1/completions", json=body) as resp:
        if resp.status_code != 200:
            raise RuntimeError(f"HTTP {resp.status_code}: {(await resp.aread())[:300]!r}")
        replica = resp.headers.get("x-pagefleet-replica", url)
        async for line in resp.aiter_lines():
            if ttft is None and line.startswith("data: {"):
                ttft = time.perf_counter() - start
    end = time.perf_counter()
    return {"tenant": req["tenant"], "replica": replica, "ttft": ttft, "start": start - t0, "end": end - t0}


async def run_load(url: str, reqs: list[dict], salt: str, args) -> dict:
    sem = asyncio.Semaphore(args.concurrency)
    limits = httpx.Limits(max_connections=args.concurrency + 4)
    async with httpx.AsyncClient(timeout=None, limits=limits) as client:
        t0 = time.perf_counter()

        async def bounded(r: dict) -> dict:
            async with sem:
                return await one(client, url, r, salt, args.output_len, t0)

        results = await asyncio.gather(*(bounded(r) for r in reqs))
        wall = time.perf_counter() - t0
    return {"wall_s": wall, "requests_per_s": len(results) / wall,
            "output_tokens_per_s": len(results) * args.output_len / wall,
            "ttft_s": percentiles([r["ttft"] for r in results]), "results": results}


def in_flight_balance(results: list[dict], replicas: list[str], wall: float) -> dict:
    """Time-averaged in-flight requests per replica (exact, from request intervals)."""
    busy = {r: 0.0 for r in replicas}
    count = {r: 0 for r in replicas}
    for x in results:
        busy[x["replica"]] += x["end"] - x["start"]
        count[x["replica"]] += 1
    avg = {r: busy[r] / wall for r in replicas}
    mean = statistics.fmean(avg.values())
    return {"avg_in_flight": avg, "requests": count, "max_over_mean": max(avg.values()) / mean}


async def overhead(direct_url: str, router_url: str, n: int, prompt: str) -> dict:
    """Alternate the same small request direct / via router; paired differences cancel drift."""
    body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": 1, "temperature": 0}
    lat: dict[str, list[float]] = {"direct": [], "router": []}
    async with httpx.AsyncClient(timeout=60) as client:
        for _ in range(5):  # warm connections and the prefix cache
            await client.post(f"{direct_url}/v1/completions", json=body)
            await client.post(f"{router_url}/v1/completions", json=body)
        for i in range(n):
            order = ("direct", "router") if i % 2 == 0 else ("router", "direct")
            for what in order:
                url = direct_url if what == "direct" else router_url
                t = time.perf_counter()
                r = await client.post(f"{url}/v1/completions", json=body)
                lat[what].append(time.perf_counter() - t)
                assert r.status_code == 200, r.text
    diffs = [b - a for a, b in zip(lat["direct"], lat["router"], strict=True)]
    return {"n": n, "direct_p50_s": statistics.median(lat["direct"]), "router_p50_s": statistics.median(lat["router"]),
            "added_p50_s": statistics.median(diffs)}


# ---- main ------------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--replicas", type=int, default=4)
    p.add_argument("--tenants", type=int, default=8)
    p.add_argument("--prefix-len", type=int, default=1024, help="tokens of each tenant's system prompt")
    p.add_argument("--num-requests", type=int, default=256)
    p.add_argument("--output-len", type=int, default=16)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--rounds", type=int, default=2, help="rounds of (round-robin, prefix), order alternating")
    p.add_argument("--kv-cache-memory", default="32MiB",
                   help="per replica; the default holds ~5 of the 8 system prompts on the default model")
    p.add_argument("--overhead-requests", type=int, default=200)
    p.add_argument("--seed", type=int, default=0)
    ot.add_model_args(p)
    p.set_defaults(hidden_size=384, num_layers=6, num_heads=6, num_kv_heads=2, intermediate_size=1024)
    p.add_argument("--result-json", default=str(ROOT / "bench/results/router.json"))
    args = p.parse_args(argv)

    model = ot.ensure_checkpoint(args)
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model)
    special = set(ot.special_token_ids(model, config))
    procs: list[subprocess.Popen] = []
    try:
        engines = []
        for _ in range(args.replicas):
            proc, url = start([PAGEFLEET, "engine", "--model", str(model), "--served-model-name", MODEL_NAME,
                               "--dtype", args.dtype, "--kv-cache-memory", args.kv_cache_memory, "--threads", "1"])
            procs.append(proc)
            engines.append(url)
        for proc, url in zip(procs, engines, strict=True):
            wait_healthy(proc, url, f"engine {url}")
        routers = {}
        for policy in ("round-robin", "prefix"):
            proc, url = start([PAGEFLEET, "router", "--pool", f"main={MODEL_NAME}:{','.join(engines)}",
                               "--tokenizer", f"main={model}", "--policy", policy])
            procs.append(proc)
            wait_healthy(proc, url, f"router {policy}")
            routers[policy] = url

        runs: list[dict] = []
        for rnd in range(args.rounds):
            reqs = make_requests(args, config.vocab_size, special, args.seed + rnd, skewed=False)
            for policy in (("round-robin", "prefix") if rnd % 2 == 0 else ("prefix", "round-robin")):
                print(f"round {rnd}: {policy} ...", file=sys.stderr)
                q0, h0 = engine_counters(engines)
                res = asyncio.run(run_load(routers[policy], reqs, f"{policy}-{rnd}", args))
                q1, h1 = engine_counters(engines)
                res["hit_rate"] = (h1 - h0) / max(q1 - q0, 1)
                res["balance"] = in_flight_balance(res["results"], engines, res["wall_s"])
                res.update(policy=policy, round=rnd)
                runs.append(res)
                print(f"  hit rate {res['hit_rate']:.1%}, {res['requests_per_s']:.2f} req/s, "
                      f"TTFT p50 {res['ttft_s']['p50'] * 1e3:.0f} ms", file=sys.stderr)

        print("skewed load (prefix) ...", file=sys.stderr)
        reqs = make_requests(args, config.vocab_size, special, args.seed + 1000, skewed=True)
        q0, h0 = engine_counters(engines)
        skew = asyncio.run(run_load(routers["prefix"], reqs, "skewed", args))
        q1, h1 = engine_counters(engines)
        skew["hit_rate"] = (h1 - h0) / max(q1 - q0, 1)
        skew["balance"] = in_flight_balance(skew["results"], engines, skew["wall_s"])

        over = {}
        probe = "Summarize the following paragraph in one sentence. " * 8
        for policy in ("round-robin", "prefix"):
            print(f"router overhead ({policy}) ...", file=sys.stderr)
            # Pin both paths to one replica: the one the router picks (round-robin moves on every
            # request, so it is measured against whichever replica answered the warm-up).
            home = httpx.post(f"{routers['prefix']}/v1/completions", timeout=60, json={
                "model": MODEL_NAME, "prompt": probe, "max_tokens": 1}).headers["x-pagefleet-replica"]
            over[policy] = asyncio.run(overhead(home, routers[policy], args.overhead_requests, probe))
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()

    def med(policy: str, key) -> float:
        return statistics.median(key(r) for r in runs if r["policy"] == policy)

    summary = {
        pol: {"hit_rate": med(pol, lambda r: r["hit_rate"]),
              "requests_per_s": med(pol, lambda r: r["requests_per_s"]),
              "ttft_p50_s": med(pol, lambda r: r["ttft_s"]["p50"]),
              "ttft_p90_s": med(pol, lambda r: r["ttft_s"]["p90"]),
              "max_over_mean_in_flight": med(pol, lambda r: r["balance"]["max_over_mean"])}
        for pol in ("prefix", "round-robin")}
    pre, rr = summary["prefix"], summary["round-robin"]
    ratios = {"throughput": pre["requests_per_s"] / rr["requests_per_s"],
              "ttft_p50_speedup": rr["ttft_p50_s"] / pre["ttft_p50_s"],
              "ttft_p90_speedup": rr["ttft_p90_s"] / pre["ttft_p90_s"]}
    for r in runs + [skew]:
        r.pop("results")
    command = [".venv/bin/python", "bench/router.py", *(argv or sys.argv[1:])]
    out = {"command": " ".join(shlex.quote(a) for a in command),
           "machine": ot.machine_info(1), "model": ot.model_info(model, config, args.dtype), "args": vars(args),
           "summary": summary, "ratios": ratios, "runs": runs, "skewed": skew, "overhead": over}
    Path(args.result_json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.result_json).write_text(json.dumps(out, indent=2))

    print(f"\n{args.replicas} replicas, {args.tenants} tenants x {args.prefix_len}-token system prompts, "
          f"{args.num_requests} requests at concurrency {args.concurrency}, median of {args.rounds} rounds\n")
    print("| policy | engine prefix-cache hit rate | req/s | TTFT p50 (ms) | TTFT p90 (ms) | max/mean in-flight |")
    print("|---|---|---|---|---|---|")
    for pol, s in summary.items():
        print(f"| {pol} | {s['hit_rate']:.1%} | {s['requests_per_s']:.2f} | {s['ttft_p50_s'] * 1e3:.0f} | "
              f"{s['ttft_p90_s'] * 1e3:.0f} | {s['max_over_mean_in_flight']:.2f} |")
    print(f"\nprefix / round-robin: throughput {ratios['throughput']:.2f}x, TTFT p50 {ratios['ttft_p50_speedup']:.2f}x "
          f"faster, p90 {ratios['ttft_p90_speedup']:.2f}x faster")
    b = skew["balance"]
    print(f"skewed (tenant 0 = half the traffic): max/mean time-averaged in-flight {b['max_over_mean']:.2f}, "
          f"hit rate {skew['hit_rate']:.1%}, requests per replica {list(b['requests'].values())}")
    for policy, o in over.items():
        print(f"router overhead ({policy}): p50 added latency {o['added_p50_s'] * 1e3:.2f} ms "
              f"(direct p50 {o['direct_p50_s'] * 1e3:.1f} ms, via router {o['router_p50_s'] * 1e3:.1f} ms)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
