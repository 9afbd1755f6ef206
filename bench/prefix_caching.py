#!/usr/bin/env python3
"""Prefix caching in pagefleet's engine: caching ON vs OFF, side by side in one run.

Two ``pagefleet.engine.LLM`` instances are loaded once from the same weights, with the same dtype, KV budget,
scheduler limits and torch thread count; they differ only in ``enable_prefix_caching``. Both run two seeded
workloads of random token ids (special ids excluded), greedy, ``ignore_eos``, so every request generates
exactly ``--output-len`` tokens:

shared
    ``--num-requests`` requests = one ``--prefix-len``-token system prompt + ``--suffix-len`` distinct
    tokens each. What caching should save: the system prompt is computed once and reused.
nosharing
    ``--num-requests`` fully distinct prompts of ``--prefix-len + --suffix-len`` tokens. Nothing repeats, so
    caching can only cost (hashing, lookups, cache bookkeeping): this shows its overhead.

Every timed run starts cold: each instance is warmed up once with a tiny request (lazy init, allocator), and
the prefix cache is reset before every timed run. So in the shared workload the first request computes the
system prompt itself; later requests can hit blocks that an earlier request registered, including one
admitted earlier in the same engine step (the engine registers a block when it is scheduled to be filled).
All requests are added at once at the start of ``generate``; time to first token (TTFT) is measured by the
engine from that moment. The total time is the wall time of the ``generate`` call.

The machine this runs on is shared and noisy, so rounds are interleaved ABBA-style (round 0: on, off;
round 1: off, on; ...) so that drift hits both systems alike; per-round numbers and the median over rounds
are reported, and ratios are computed between the medians. Prompt tokens computed and cache hits are
counters, not timings: they do not depend on noise.

Reported per system and workload: prompt (prefill) tokens computed, prefix-cache hit tokens, TTFT median and
p90, total time, output tokens/s; ratios: prefill-token reduction (1 - on/off), TTFT off/on, total time
off/on, and for nosharing on/off time (overhead). Greedy outputs must be identical ON vs OFF: the script
reports how many are, and exits non-zero on any mismatch.

Usage (from the repository root)::

    # full benchmark: ~125M Llama (built once into bench/.cache/, shared with offline_throughput.py)
    .venv/bin/python bench/prefix_caching.py
    # smoke test on a tiny model (seconds)
    .venv/bin/python bench/prefix_caching.py --hidden-size 64 --num-layers 2 --num-heads 4 \\
        --num-kv-heads 2 --intermediate-size 128 --vocab-size 512 --num-requests 4 --prefix-len 64 \\
        --suffix-len 16 --output-len 4 --kv-budget 64MiB --result-json /tmp/pc.json
    # more rounds on a noisy machine, or an existing HF checkpoint
    .venv/bin/python bench/prefix_caching.py --rounds 4
    .venv/bin/python bench/prefix_caching.py --model /path/to/hf/checkpoint

Results: a markdown table on stdout and a JSON file (``--result-json``) with machine info, the exact command
line and all numbers.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shlex
import statistics
import sys
import time
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

# Same reason as in offline_throughput.py: must be set before torch loads OpenMP. Spinning OpenMP workers
# on cores shared with other jobs make small matmuls erratic; PASSIVE applies to both instances alike.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import numpy as np  # noqa: E402
import torch  # noqa: E402

BENCH_DIR = Path(__file__).resolve().parent
# Reuse offline_throughput's checkpoint builder (and its cache key), so the ~125M model is built once and
# both benchmarks measure the very same weights.
sys.path.insert(0, str(BENCH_DIR))
from offline_throughput import (  # noqa: E402
    add_model_args,
    agreement,
    ensure_checkpoint,
    machine_info,
    model_info,
    special_token_ids,
)

DEFAULT_RESULT_JSON = BENCH_DIR / "results" / "prefix_caching.json"
SYSTEMS = ("on", "off")  # enable_prefix_caching True / False
WORKLOADS = ("shared", "nosharing")
# Targets from the issue; recorded in the JSON and checked in the table.
TARGET_PREFILL_REDUCTION = 0.90  # shared: >= 90% fewer prompt tokens computed with caching
TARGET_TTFT_SPEEDUP = 4.0  # shared: median and p90 TTFT >= 4x lower with caching
TARGET_NOSHARING_OVERHEAD = 1.03  # nosharing: caching at most 3% slower


# ----------------------------------------------------------------------------------------------------
# Workloads
# ----------------------------------------------------------------------------------------------------


def make_workloads(args: argparse.Namespace, vocab_size: int, special_ids: set[int]) -> dict[str, list[list[int]]]:
    """Seeded random prompts. Special ids are excluded so that no prompt token acts as BOS/EOS/pad."""
    rng = np.random.default_rng(args.seed)
    allowed = np.setdiff1d(np.arange(vocab_size), np.fromiter(special_ids, dtype=np.int64, count=len(special_ids)))

    def draw(n: int) -> list[int]:
        return allowed[rng.integers(0, len(allowed), size=n)].tolist()

    n, total = args.num_requests, args.prefix_len + args.suffix_len
    system = draw(args.prefix_len)
    shared = [system + draw(args.suffix_len) for _ in range(n)]
    nosharing = [draw(total) for _ in range(n)]
    bs = args.block_size
    # "Distinct" must hold at block granularity, or the workloads would share more (or less) than intended:
    # shared prompts must differ in the first block past the system prompt, nosharing prompts in their first
    # block (block hashes chain, so a differing first block means nothing further can match).
    if args.suffix_len >= bs:
        firsts = {tuple(p[args.prefix_len : args.prefix_len + bs]) for p in shared}
        assert len(firsts) == n, "shared workload: two suffixes share their first block; change --seed"
    if total >= bs:
        assert len({tuple(p[:bs]) for p in nosharing}) == n, "nosharing workload: prompts share a first block"
    return {"shared": shared, "nosharing": nosharing}


# ----------------------------------------------------------------------------------------------------
# One timed run
# ----------------------------------------------------------------------------------------------------


@dataclass
class Run:
    system: str
    workload: str
    round: int
    wall_s: float
    ttft_s: list[float]
    num_cached_tokens: list[int]  # per request, from RequestOutput
    outputs: list[list[int]]
    counters: dict[str, int]  # deltas of the engine's cumulative counters over this run
    summary: dict[str, Any] = field(default_factory=dict)


def _stats(llm) -> dict[str, Any]:
    return asdict(llm.stats())


# Cumulative EngineStats fields: a run's share is after - before.
DELTA_FIELDS = (
    "num_prompt_tokens_computed",
    "num_computed_tokens",
    "prefix_cache_queries",
    "prefix_cache_hits",
    "num_steps",
    "num_preemptions",
)


def run_once(llm, system: str, workload: str, rnd: int, prompts: list[list[int]], args: argparse.Namespace) -> Run:
    from pagefleet.engine import SamplingParams

    # Cold start for every timed run: no blocks left over from the warm-up or an earlier round. (A no-op for
    # the OFF instance, called anyway so both do the same work outside the timed interval.)
    llm.reset_prefix_cache()
    # torch's thread count is process-wide: re-assert it so neither instance inherits another setting.
    torch.set_num_threads(args.threads)
    gc.collect()  # keep a collection of the previous run's garbage out of this run's timing
    params = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    before = _stats(llm)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    wall = time.perf_counter() - t0
    after = _stats(llm)
    assert len(outs) == len(prompts), f"{len(outs)} outputs for {len(prompts)} prompts"
    for i, (o, p) in enumerate(zip(outs, prompts, strict=True)):
        # A reordering would silently corrupt the ON/OFF comparison.
        assert list(o.prompt_token_ids) == p, f"output {i} does not belong to prompt {i}"
    ttft = [o.metrics.time_to_first_token for o in outs]
    assert all(t is not None for t in ttft), "a finished request has no first-token time"
    counters = {k: int(after[k] - before[k]) for k in DELTA_FIELDS}
    counters["peak_num_running"] = int(after["peak_num_running"])  # a high-water mark, not a delta
    return Run(
        system=system,
        workload=workload,
        round=rnd,
        wall_s=wall,
        ttft_s=[float(t) for t in ttft],
        num_cached_tokens=[int(o.num_cached_tokens) for o in outs],
        outputs=[list(o.outputs[0].token_ids) for o in outs],
        counters=counters,
    )


def p90(xs: list[float]) -> float:
    # numpy's default (linear interpolation between closest ranks); with 32 requests that sits between the
    # 28th and 29th fastest.
    return float(np.percentile(xs, 90))


def summarize_run(r: Run, num_prompt_tokens: int) -> dict[str, Any]:
    out_tokens = sum(len(o) for o in r.outputs)
    return {
        "round": r.round,
        "wall_s": round(r.wall_s, 4),
        "ttft_median_s": round(statistics.median(r.ttft_s), 4),
        "ttft_p90_s": round(p90(r.ttft_s), 4),
        "ttft_min_s": round(min(r.ttft_s), 4),
        "ttft_max_s": round(max(r.ttft_s), 4),
        "prompt_tokens": num_prompt_tokens,
        "prompt_tokens_computed": r.counters["num_prompt_tokens_computed"],
        "prefix_cache_hit_tokens": r.counters["prefix_cache_hits"],
        "prefix_cache_query_tokens": r.counters["prefix_cache_queries"],
        "sum_num_cached_tokens": sum(r.num_cached_tokens),
        "first_request_cached_tokens": r.num_cached_tokens[0],
        "computed_tokens": r.counters["num_computed_tokens"],
        "output_tokens": out_tokens,
        "output_tokens_per_s": round(out_tokens / r.wall_s, 2),
        "num_steps": r.counters["num_steps"],
        "num_preemptions": r.counters["num_preemptions"],
        "peak_num_running": r.counters["peak_num_running"],
    }


# ----------------------------------------------------------------------------------------------------
# Main
# ----------------------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0] + " Prints a markdown table; writes a JSON result file.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    add_model_args(p)

    g = p.add_argument_group("workloads (seeded random token ids; greedy; ignore_eos)")
    g.add_argument("--num-requests", type=int, default=32, help="requests per workload")
    g.add_argument("--prefix-len", type=int, default=1024, help="shared: system-prompt tokens common to every request")
    g.add_argument(
        "--suffix-len",
        type=int,
        default=64,
        help="shared: distinct tokens per request after the system prompt "
        "(nosharing prompts are prefix-len + suffix-len fully distinct tokens)",
    )
    g.add_argument("--output-len", type=int, default=32, help="generated tokens per request (exact: ignore_eos)")
    g.add_argument(
        "--workloads", default=",".join(WORKLOADS), help=f"comma-separated workloads to run, from {','.join(WORKLOADS)}"
    )
    g.add_argument("--seed", type=int, default=0)

    g = p.add_argument_group("run")
    g.add_argument("--threads", type=int, default=2, help="torch.set_num_threads for both instances")
    g.add_argument(
        "--rounds",
        type=int,
        default=2,
        help="timed runs per system and workload, interleaved on/off, off/on, ... (median reported)",
    )
    g.add_argument("--result-json", type=Path, default=DEFAULT_RESULT_JSON)

    g = p.add_argument_group("engine settings (identical for both instances except enable_prefix_caching)")
    g.add_argument("--kv-budget", default="2GiB", help="kv_cache_memory per instance")
    g.add_argument("--block-size", type=int, default=16, help="KV block size (tokens)")
    g.add_argument("--max-num-seqs", type=int, default=256)
    g.add_argument("--max-batch-tokens", type=int, default=2048, help="max_num_batched_tokens (per-step budget)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    workloads_sel = [w.strip() for w in args.workloads.split(",") if w.strip()]
    unknown = set(workloads_sel) - set(WORKLOADS)
    if unknown:
        raise SystemExit(f"unknown workload(s) in --workloads: {sorted(unknown)}")
    if args.rounds < 1:
        raise SystemExit("--rounds must be >= 1")
    load_at_start = list(os.getloadavg()) if hasattr(os, "getloadavg") else None
    torch.set_num_threads(args.threads)

    from transformers import AutoConfig

    from pagefleet.engine import LLM, SamplingParams

    model_path = ensure_checkpoint(args)
    config = AutoConfig.from_pretrained(model_path)
    workloads = make_workloads(args, config.vocab_size, special_token_ids(model_path, config))
    workloads = {w: workloads[w] for w in workloads_sel}

    errors: dict[str, str] = {}
    llms: dict[str, Any] = {}
    for name in SYSTEMS:
        try:
            t0 = time.perf_counter()
            llms[name] = LLM(
                model=str(model_path),
                dtype=args.dtype,
                block_size=args.block_size,
                kv_cache_memory=args.kv_budget,
                max_num_seqs=args.max_num_seqs,
                max_num_batched_tokens=args.max_batch_tokens,
                num_threads=args.threads,
                seed=args.seed,
                enable_prefix_caching=(name == "on"),
            )
            load_s = time.perf_counter() - t0
            # Warm-up: a tiny request triggers lazy init and allocator growth outside the timed runs.
            warm_prompt = next(iter(workloads.values()))[0][:16]
            llms[name].generate([warm_prompt], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
            print(f"[{name}] loaded in {load_s:.1f}s, warmed up", file=sys.stderr)
        except Exception:
            errors[f"setup_{name}"] = traceback.format_exc()
            print(f"[{name}] FAILED in setup/warm-up:\n{errors[f'setup_{name}']}", file=sys.stderr)

    runs: list[Run] = []
    for rnd in range(args.rounds):
        # ABBA interleaving: on,off then off,on ... so slow drift of the machine's load favours neither.
        order = SYSTEMS if rnd % 2 == 0 else tuple(reversed(SYSTEMS))
        for wname, prompts in workloads.items():
            for name in order:
                if name not in llms:
                    continue
                key = f"{wname}_{name}_round{rnd}"
                try:
                    r = run_once(llms[name], name, wname, rnd, prompts, args)
                except Exception:
                    errors[key] = traceback.format_exc()
                    print(f"[{key}] FAILED:\n{errors[key]}", file=sys.stderr)
                    continue
                r.summary = summarize_run(r, sum(len(p) for p in prompts))
                runs.append(r)
                s = r.summary
                print(
                    f"[round {rnd}] {wname:9s} caching {name:3s}: {s['wall_s']:.2f}s total, "
                    f"TTFT median {s['ttft_median_s']:.3f}s p90 {s['ttft_p90_s']:.3f}s, "
                    f"prompt tokens computed {s['prompt_tokens_computed']}",
                    file=sys.stderr,
                )
    llms.clear()
    gc.collect()

    result = summarize(args, model_path, config, workloads, runs, errors)
    result["machine"]["loadavg_at_start"] = load_at_start
    print(render_markdown(result))
    args.result_json.parent.mkdir(parents=True, exist_ok=True)
    args.result_json.write_text(json.dumps(result, indent=2) + "\n")
    print(f"\nresults written to {args.result_json}", file=sys.stderr)
    mismatch = any(a["identical"] != a["of"] for a in result["output_agreement"].values())
    return 1 if errors or mismatch else 0


def _ratio(a: float | None, b: float | None, nd: int = 3) -> float | None:
    return None if a is None or b is None or b == 0 else round(a / b, nd)


def summarize(args, model_path, config, workloads, runs: list[Run], errors: dict[str, str]) -> dict[str, Any]:
    results: dict[str, dict[str, Any]] = {}
    for wname in workloads:
        results[wname] = {}
        for name in SYSTEMS:
            rs = [r for r in runs if r.workload == wname and r.system == name]
            if not rs:
                continue
            sums = [r.summary for r in rs]
            med = {
                k: round(statistics.median(s[k] for s in sums), 4)
                for k in ("wall_s", "ttft_median_s", "ttft_p90_s", "output_tokens_per_s")
            }
            # Counters are the same every round for a deterministic engine; report the last round's and flag
            # any round that differs.
            last = sums[-1]
            counters_stable = all(
                s[k] == last[k] for s in sums for k in ("prompt_tokens_computed", "prefix_cache_hit_tokens")
            )
            results[wname][name] = {
                **med,
                "prompt_tokens": last["prompt_tokens"],
                "prompt_tokens_computed": last["prompt_tokens_computed"],
                "prefix_cache_hit_tokens": last["prefix_cache_hit_tokens"],
                "sum_num_cached_tokens": last["sum_num_cached_tokens"],
                "first_request_cached_tokens": last["first_request_cached_tokens"],
                "output_tokens": last["output_tokens"],
                "counters_stable_across_rounds": counters_stable,
                "rounds": sums,
            }

    ratios: dict[str, Any] = {}
    sh = results.get("shared", {})
    if "on" in sh and "off" in sh:
        on, off = sh["on"], sh["off"]
        red = 1 - on["prompt_tokens_computed"] / off["prompt_tokens_computed"]
        ratios["shared"] = {
            "prefill_tokens_reduction": round(red, 4),
            "ttft_median_off_over_on": _ratio(off["ttft_median_s"], on["ttft_median_s"]),
            "ttft_p90_off_over_on": _ratio(off["ttft_p90_s"], on["ttft_p90_s"]),
            "total_time_off_over_on": _ratio(off["wall_s"], on["wall_s"]),
            # Same ratios paired within each round: how much of the result is round-to-round noise.
            "per_round": [
                {
                    "round": a["round"],
                    "ttft_median_off_over_on": _ratio(b["ttft_median_s"], a["ttft_median_s"]),
                    "ttft_p90_off_over_on": _ratio(b["ttft_p90_s"], a["ttft_p90_s"]),
                    "total_time_off_over_on": _ratio(b["wall_s"], a["wall_s"]),
                }
                for a, b in zip(on["rounds"], off["rounds"], strict=False)
            ],
        }
    ns = results.get("nosharing", {})
    if "on" in ns and "off" in ns:
        ratios["nosharing"] = {
            "total_time_on_over_off": _ratio(ns["on"]["wall_s"], ns["off"]["wall_s"], 4),
            "ttft_median_on_over_off": _ratio(ns["on"]["ttft_median_s"], ns["off"]["ttft_median_s"], 4),
            "per_round_total_time_on_over_off": [
                _ratio(a["wall_s"], b["wall_s"], 4)
                for a, b in zip(ns["on"]["rounds"], ns["off"]["rounds"], strict=False)
            ],
        }

    targets = {}
    if "shared" in ratios:
        r = ratios["shared"]
        targets["prefill_tokens_reduction >= 90%"] = r["prefill_tokens_reduction"] >= TARGET_PREFILL_REDUCTION
        targets["TTFT median >= 4x lower"] = (r["ttft_median_off_over_on"] or 0) >= TARGET_TTFT_SPEEDUP
        targets["TTFT p90 >= 4x lower"] = (r["ttft_p90_off_over_on"] or 0) >= TARGET_TTFT_SPEEDUP
    if "nosharing" in ratios:
        v = ratios["nosharing"]["total_time_on_over_off"]
        targets["nosharing overhead <= 3%"] = v is not None and v <= TARGET_NOSHARING_OVERHEAD

    # Greedy outputs ON vs OFF in the same round must be identical: caching may only skip work whose result
    # is already in the cache. Also each system against its own round 0 (determinism across rounds).
    agree: dict[str, Any] = {}
    for wname in workloads:
        for rnd in range(args.rounds):
            pair = {r.system: r for r in runs if r.workload == wname and r.round == rnd}
            if "on" in pair and "off" in pair:
                agree[f"{wname}_round{rnd}_on_vs_off"] = agreement(pair["on"].outputs, pair["off"].outputs)
        for name in SYSTEMS:
            rs = [r for r in runs if r.workload == wname and r.system == name]
            for r in rs[1:]:
                agree[f"{wname}_{name}_round0_vs_round{r.round}"] = agreement(rs[0].outputs, r.outputs)

    return {
        "benchmark": "prefix_caching",
        "command": " ".join(shlex.quote(x) for x in [".venv/bin/python", "bench/prefix_caching.py", *sys.argv[1:]]),
        "argv": sys.argv,
        "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "machine": machine_info(args.threads),
        "model": model_info(model_path, config, args.dtype),
        "engine": {
            "block_size": args.block_size,
            "kv_cache_memory": args.kv_budget,
            "max_num_seqs": args.max_num_seqs,
            "max_num_batched_tokens": args.max_batch_tokens,
        },
        "workload": {
            "num_requests": args.num_requests,
            "prefix_len": args.prefix_len,
            "suffix_len": args.suffix_len,
            "output_len": args.output_len,
            "workloads": list(workloads),
            "seed": args.seed,
            "greedy": True,
            "ignore_eos": True,
            "cold_start": "prefix cache reset before every timed run; the first shared request computes the "
            "system prompt itself",
        },
        "rounds": args.rounds,
        "ttft_p90_method": "numpy.percentile linear interpolation",
        "results": results,
        "ratios": ratios,
        "targets": {
            "prefill_tokens_reduction_min": TARGET_PREFILL_REDUCTION,
            "ttft_speedup_min": TARGET_TTFT_SPEEDUP,
            "nosharing_time_ratio_max": TARGET_NOSHARING_OVERHEAD,
            "met": targets,
        },
        "output_agreement": agree,
        "errors": errors,
    }


def render_markdown(r: dict[str, Any]) -> str:
    m, w, md, e = r["machine"], r["workload"], r["model"], r["engine"]
    load = ""
    if m.get("loadavg_at_start") and m.get("loadavg_at_end"):
        load = f"; 1-min load average {m['loadavg_at_start'][0]:.1f} at start, {m['loadavg_at_end'][0]:.1f} at end"
    n = md.get("num_parameters")
    params = f"{n / 1e6:.{0 if n >= 1e7 else 2}f}M params, " if n else ""
    lines = [
        "## Prefix caching",
        "",
        f"Command: `{r['command']}`",
        "",
        f"Machine: {m['cpu_model']}, {m['cpu_affinity'] or m['cpu_count']} usable cores, "
        f"torch {m['torch']} ({m['torch_threads']} threads, OMP_WAIT_POLICY={m['omp_wait_policy']}){load}",
        "",
        f"Model: {md['arch']}, {params}hidden {md['hidden_size']}, {md['num_hidden_layers']} layers, "
        f"{md['num_attention_heads']} heads / {md['num_key_value_heads']} KV heads, vocab {md['vocab_size']}, "
        f"{md['dtype']}, random weights. Engine: block_size {e['block_size']}, kv_cache_memory "
        f"{e['kv_cache_memory']}, max_num_seqs {e['max_num_seqs']}, max_num_batched_tokens "
        f"{e['max_num_batched_tokens']}; the two instances differ only in enable_prefix_caching.",
        "",
        f"Workloads ({w['num_requests']} requests each, {w['output_len']} output tokens each, greedy, ignore_eos, "
        f"seed {w['seed']}, all requests added at once): shared = one {w['prefix_len']}-token system prompt + "
        f"{w['suffix_len']} distinct tokens per request; nosharing = {w['prefix_len'] + w['suffix_len']} fully "
        f"distinct tokens per request. Prefix cache reset before every timed run (the first shared request "
        f"computes the system prompt itself). Median of {r['rounds']} interleaved rounds.",
        "",
        "| workload | caching | prompt tokens | prompt tokens computed | prefix-cache hit tokens "
        "| TTFT median s | TTFT p90 s | total s | output tokens/s |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for wname, per in r["results"].items():
        for name in SYSTEMS:
            x = per.get(name)
            if x is None:
                lines.append(f"| {wname} | {name} | failed (see errors) | | | | | | |")
                continue
            flag = "" if x["counters_stable_across_rounds"] else " (varies by round!)"
            lines.append(
                f"| {wname} | {name} | {x['prompt_tokens']} | {x['prompt_tokens_computed']}{flag} "
                f"| {x['prefix_cache_hit_tokens']} | {x['ttft_median_s']:.3f} | {x['ttft_p90_s']:.3f} "
                f"| {x['wall_s']:.2f} | {x['output_tokens_per_s']:.1f} |"
            )
    rt, met = r["ratios"], r["targets"]["met"]

    def yn(key: str) -> str:
        return "met" if met.get(key) else "NOT met"

    lines += ["", "| ratio | value | target | |", "|---|---:|---|---|"]
    if "shared" in rt:
        s = rt["shared"]
        lines += [
            f"| shared: prompt tokens computed, reduction (1 - on/off) | {s['prefill_tokens_reduction']:.1%} "
            f"| >= 90% | {yn('prefill_tokens_reduction >= 90%')} |",
            f"| shared: TTFT median off/on | {s['ttft_median_off_over_on']:.2f}x | >= 4x "
            f"| {yn('TTFT median >= 4x lower')} |",
            f"| shared: TTFT p90 off/on | {s['ttft_p90_off_over_on']:.2f}x | >= 4x | {yn('TTFT p90 >= 4x lower')} |",
            f"| shared: total time off/on | {s['total_time_off_over_on']:.2f}x | - | |",
        ]
    if "nosharing" in rt:
        v = rt["nosharing"]["total_time_on_over_off"]
        per = ", ".join(f"{x:.3f}" for x in rt["nosharing"]["per_round_total_time_on_over_off"] if x is not None)
        lines.append(
            f"| nosharing: total time on/off (overhead) | {v:.3f} (rounds: {per}) | <= 1.03 "
            f"| {yn('nosharing overhead <= 3%')} |"
        )

    lines += [
        "",
        "Per round (TTFT median / p90 / total seconds):",
        "",
        "| round | workload | on | off |",
        "|---:|---|---|---|",
    ]
    for wname, per in r["results"].items():
        rows_on = {x["round"]: x for x in per.get("on", {}).get("rounds", [])}
        rows_off = {x["round"]: x for x in per.get("off", {}).get("rounds", [])}
        for rnd in sorted(set(rows_on) | set(rows_off)):
            cell = [
                f"{x['ttft_median_s']:.3f} / {x['ttft_p90_s']:.3f} / {x['wall_s']:.2f}" if x else "-"
                for x in (rows_on.get(rnd), rows_off.get(rnd))
            ]
            lines.append(f"| {rnd} | {wname} | {cell[0]} | {cell[1]} |")

    if r["output_agreement"]:
        lines += ["", "Greedy outputs (must be identical):"]
        for k, v in r["output_agreement"].items():
            extra = "" if not v["diverged"] else f" (first divergence: {v['diverged'][0]})"
            lines.append(f"- {k}: {v['identical']}/{v['of']} identical{extra}")
    if r["errors"]:
        lines += ["", "Errors:"]
        for k, v in r["errors"].items():
            lines.append(f"- {k}: {v.strip().splitlines()[-1]}")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
