#!/usr/bin/env python3
"""Offline generation throughput: pagefleet's engine vs Hugging Face transformers, side by side in one run.

Three systems generate the same seeded workload from the same weights, dtype and torch thread count:

ours
    ``pagefleet.engine.LLM.generate`` (paged KV cache, continuous batching, chunked prefill).
generate
    ``transformers`` ``model.generate`` on static, left-padded batches in arrival order. A batch runs until
    its longest request is done (``max_new_tokens`` = batch max), so the tokens a short request keeps
    generating past its own length are waste: the table counts only each request's own output length as
    useful, and reports the raw count separately.
generate_batch
    ``transformers`` continuous batching (the machinery behind ``model.generate_batch``) with an explicit
    ``num_blocks`` sized to the same KV byte budget as ours and the same ``max_batch_tokens``. Requests go
    through the manager that ``generate_batch`` wraps, because ``generate_batch`` takes one
    ``max_new_tokens`` for all requests while ``add_request`` takes it per request: that way it does exactly
    the useful work, like ours.

The machine this runs on is noisy and shared, so absolute tokens/s are not comparable across runs: the
ratios between systems measured in the same run are the result. Each system is warmed up with a tiny run
first, and only the submit-to-last-result interval of the full workload is timed (model loading and KV
allocation are not).

The script also reports KV capacity: for a fixed KV byte budget, how many tokens / concurrent sequences the
paged cache holds (and how many our engine actually ran at its peak) versus reserving ``max_model_len``
tokens per sequence, as a contiguous per-sequence cache would.

Usage (from the repository root)::

    # full benchmark: ~125M Llama, 64 requests, all three systems
    .venv/bin/python bench/offline_throughput.py
    # smoke test on a tiny model
    .venv/bin/python bench/offline_throughput.py --hidden-size 64 --num-layers 2 --num-heads 4 \\
        --num-kv-heads 2 --intermediate-size 128 --vocab-size 512 --num-requests 4 --max-prompt 64 \\
        --max-output 16 --kv-budget 64MiB --small-kv-budget 4MiB
    # peers only, or an existing HF checkpoint
    .venv/bin/python bench/offline_throughput.py --peers generate,generate_batch
    .venv/bin/python bench/offline_throughput.py --model /path/to/hf/checkpoint

The checkpoint is built once (random weights, ``pagefleet.engine.testing.make_tiny_checkpoint``) into
``bench/.cache/`` and reused. Results: a markdown table on stdout and a JSON file (``--result-json``).
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import math
import os
import platform
import re
import shlex
import statistics
import sys
import time
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

# Must be set before torch loads its OpenMP runtime. With the default (spinning) wait policy, OpenMP worker
# threads busy-wait between parallel regions; on a machine whose cores are shared with other jobs that turns
# into contention that slowed small matmuls 10-30x in trials here, and by different amounts for different
# systems. PASSIVE (sleep when idle) applies to all three systems alike, since they share this process.
# An explicit OMP_WAIT_POLICY in the environment wins.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import numpy as np  # noqa: E402
import torch  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parent.parent
CACHE_DIR = Path(__file__).resolve().parent / ".cache"
DEFAULT_RESULT_JSON = Path(__file__).resolve().parent / "results" / "offline_throughput.json"
ALL_SYSTEMS = ("ours", "generate", "generate_batch")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


# ----------------------------------------------------------------------------------------------------
# Workload
# ----------------------------------------------------------------------------------------------------


@dataclass
class Workload:
    prompts: list[list[int]]
    output_lens: list[int]

    @property
    def num_prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)

    @property
    def num_output_tokens(self) -> int:
        return sum(self.output_lens)


def make_workload(
    num_requests: int,
    prompt_range: tuple[int, int],
    output_range: tuple[int, int],
    vocab_size: int,
    special_ids: set[int],
    seed: int,
) -> Workload:
    """Random token prompts: content does not matter for throughput, lengths do.

    Special ids are excluded so that no system treats a prompt token as BOS/EOS/pad (e.g. a
    tokenizer-aware path that strips or stops on them): every system must see exactly the same tokens.
    """
    rng = np.random.default_rng(seed)
    allowed = np.setdiff1d(np.arange(vocab_size), np.fromiter(special_ids, dtype=np.int64, count=len(special_ids)))
    prompt_lens = rng.integers(prompt_range[0], prompt_range[1] + 1, size=num_requests)
    output_lens = rng.integers(output_range[0], output_range[1] + 1, size=num_requests)
    prompts = [allowed[rng.integers(0, len(allowed), size=int(n))].tolist() for n in prompt_lens]
    return Workload(prompts=prompts, output_lens=[int(n) for n in output_lens])


def warmup_workload(workload: Workload) -> Workload:
    """A tiny slice of the real workload: enough to trigger lazy init / allocator warm-up, seconds to run."""
    prompts = [p[:16] for p in workload.prompts[:2]]
    return Workload(prompts=prompts, output_lens=[min(4, n) for n in workload.output_lens[:2]])


# ----------------------------------------------------------------------------------------------------
# Systems. Each has setup() (load, not timed), run(workload) -> RunOutput (timed inside), teardown().
# ----------------------------------------------------------------------------------------------------


@dataclass
class RunOutput:
    wall_s: float
    outputs: list[list[int]]  # generated token ids per request, in request order
    raw_generated: int  # every token the system generated, including padded-batch overshoot
    extra: dict[str, Any] = field(default_factory=dict)


class OursSystem:
    name = "ours"

    def __init__(self, model_path: Path, args: argparse.Namespace, kv_budget: str):
        self.model_path, self.args, self.kv_budget = model_path, args, kv_budget
        self.llm = None

    def describe(self) -> str:
        a = self.args
        return (
            f"pagefleet LLM: block_size={a.block_size}, kv_cache_memory={self.kv_budget}, "
            f"max_num_seqs={a.max_num_seqs}, max_num_batched_tokens={a.max_batch_tokens}"
        )

    def setup(self) -> None:
        from pagefleet.engine import LLM

        a = self.args
        self.llm = LLM(
            model=str(self.model_path),
            dtype=a.dtype,
            block_size=a.block_size,
            kv_cache_memory=self.kv_budget,
            max_num_seqs=a.max_num_seqs,
            max_num_batched_tokens=a.max_batch_tokens,
            # The engine would otherwise set torch's process-wide thread count itself.
            num_threads=a.threads,
        )

    def run(self, workload: Workload) -> RunOutput:
        from pagefleet.engine import SamplingParams

        params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in workload.output_lens]
        before = _stats_dict(self.llm.stats())
        t0 = time.perf_counter()
        outs = self.llm.generate(workload.prompts, params, use_tqdm=False)
        wall = time.perf_counter() - t0
        after = _stats_dict(self.llm.stats())
        assert len(outs) == len(workload.prompts), f"got {len(outs)} outputs for {len(workload.prompts)} prompts"
        for i, (o, p) in enumerate(zip(outs, workload.prompts, strict=True)):
            # generate() must return outputs in request order; a reordering would silently corrupt the
            # comparison.
            assert list(o.prompt_token_ids) == p, f"output {i} does not belong to prompt {i}"
        outputs = [list(o.outputs[0].token_ids) for o in outs]
        # Counters are cumulative over the LLM's life: report this run's share. Peak running is a
        # high-water mark and cannot be differenced; the warm-up only runs 2 sequences, so it cannot
        # inflate it.
        extra = {
            "stats": after,
            "num_preemptions": after.get("num_preemptions", 0) - before.get("num_preemptions", 0),
            "num_steps": after.get("num_steps", 0) - before.get("num_steps", 0),
            "peak_num_running": after.get("peak_num_running"),
        }
        return RunOutput(wall, outputs, sum(len(o) for o in outputs), extra)

    def teardown(self) -> None:
        self.llm = None


class HFGenerateSystem:
    name = "generate"

    def __init__(self, model_path: Path, args: argparse.Namespace):
        self.model_path, self.args = model_path, args
        self.model = None

    def describe(self) -> str:
        return (
            f"transformers generate: static batches of {self.args.hf_batch_size} in arrival order, "
            f"left padding + attention mask, max_new_tokens = batch max, attn={self.args.hf_attn}, "
            "DynamicCache"
        )

    def setup(self) -> None:
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(
            self.model_path, dtype=DTYPES[self.args.dtype], attn_implementation=self.args.hf_attn
        ).eval()
        # ignore_eos: with no EOS id a batch never stops early, so every row generates max_new_tokens.
        self.model.generation_config.eos_token_id = None

    def run(self, workload: Workload) -> RunOutput:
        from transformers import GenerationConfig

        model, bs = self.model, self.args.hf_batch_size
        pad_id = _pad_id(model.config)
        outputs: list[list[int]] = []
        raw = 0
        t0 = time.perf_counter()
        for start in range(0, len(workload.prompts), bs):
            prompts = workload.prompts[start : start + bs]
            out_lens = workload.output_lens[start : start + bs]
            max_new = max(out_lens)
            width = max(len(p) for p in prompts)
            ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
            mask = torch.zeros((len(prompts), width), dtype=torch.long)
            for row, p in enumerate(prompts):
                ids[row, width - len(p) :] = torch.tensor(p)
                mask[row, width - len(p) :] = 1
            cfg = GenerationConfig(
                do_sample=False,
                max_new_tokens=max_new,
                min_new_tokens=None,
                pad_token_id=pad_id,
                eos_token_id=None,
            )
            with torch.inference_mode():
                seqs = model.generate(input_ids=ids, attention_mask=mask, generation_config=cfg)
            gen = seqs[:, width:]
            assert gen.shape[1] == max_new, f"batch at {start}: generated {gen.shape[1]} tokens, wanted {max_new}"
            raw += gen.numel()
            outputs.extend(gen[row, :n].tolist() for row, n in enumerate(out_lens))
        wall = time.perf_counter() - t0
        return RunOutput(wall, outputs, raw, {"batch_size": bs})

    def teardown(self) -> None:
        self.model = None


class HFContinuousBatchingSystem:
    name = "generate_batch"

    def __init__(self, model_path: Path, args: argparse.Namespace, kv_budget_bytes: int, bytes_per_token: int):
        self.model_path, self.args = model_path, args
        # num_blocks counts whole-model blocks of page_size tokens: size it to the same KV bytes as ours.
        self.num_blocks = kv_budget_bytes // (args.cb_page_size * bytes_per_token)
        self.model = None
        self._cm = None
        self.manager = None

    def describe(self) -> str:
        a = self.args
        return (
            f"transformers continuous batching (generate_batch's manager, per-request max_new_tokens): "
            f"attn={a.cb_attn}, page_size={a.cb_page_size}, num_blocks={self.num_blocks}, "
            f"max_batch_tokens={a.max_batch_tokens}, max_requests_per_batch={a.max_num_seqs}"
        )

    def setup(self) -> None:
        from transformers import AutoModelForCausalLM, ContinuousBatchingConfig, GenerationConfig

        a = self.args
        self.model = AutoModelForCausalLM.from_pretrained(
            self.model_path, dtype=DTYPES[a.dtype], attn_implementation=a.cb_attn
        ).eval()
        gen_cfg = GenerationConfig(
            do_sample=False,
            max_new_tokens=a.max_output,
            eos_token_id=-1,
            pad_token_id=_pad_id(self.model.config),
        )
        cb_cfg = ContinuousBatchingConfig(
            page_size=a.cb_page_size,
            num_blocks=self.num_blocks,
            max_batch_tokens=a.max_batch_tokens,
            max_requests_per_batch=a.max_num_seqs,
            # num_blocks is fixed above, so this only loosens transformers' pre-flight "fits in memory"
            # check. On CPU without psutil that check sizes "device memory" from NUMA node info and keeps a
            # fraction of it, which rejects a 2GiB cache plus its dense sdpa attention mask even on a
            # machine with room to spare.
            max_memory_percent=1.0,
            # There is no flash attention on CPU; keep the implementation we asked for.
            auto_switch_to_flash=False,
            use_cuda_graph=False,
        )
        # The manager owns a background generation thread; keep it running across warm-up and timed runs (as a
        # server would) so that the timed interval is pure generation, like ours.
        self._cm = self.model.continuous_batching_context_manager(
            generation_config=gen_cfg, continuous_batching_config=cb_cfg, block=True, timeout=30
        )
        self.manager = self._cm.__enter__()

    def run(self, workload: Workload) -> RunOutput:
        m = self.manager
        t0 = time.perf_counter()
        ids = [
            m.add_request(input_ids=p, max_new_tokens=n, eos_token_id=-1)
            for p, n in zip(workload.prompts, workload.output_lens, strict=True)
        ]
        results: dict[str, Any] = {}
        while len(results) < len(ids):
            r = m.get_result(timeout=1)
            if r is None:
                if not m.is_running():
                    raise RuntimeError("transformers continuous batching thread died")
                continue
            if r.is_finished():
                if r.error is not None:
                    raise RuntimeError(f"request {r.request_id} failed: {r.error}")
                results[r.request_id] = r
        wall = time.perf_counter() - t0
        outputs = [list(results[i].generated_tokens) for i in ids]
        cache = m.batch_processor.cache if getattr(m, "batch_processor", None) is not None else None
        extra = {"num_blocks": self.num_blocks, "page_size": self.args.cb_page_size}
        if cache is not None:
            extra["resolved_num_blocks"] = int(cache.num_blocks)
            extra["resolved_max_batch_tokens"] = int(cache.max_batch_tokens)
        return RunOutput(wall, outputs, sum(len(o) for o in outputs), extra)

    def teardown(self) -> None:
        if self._cm is not None:
            self._cm.__exit__(None, None, None)
        self._cm = self.manager = self.model = None


# ----------------------------------------------------------------------------------------------------
# Helpers
# ----------------------------------------------------------------------------------------------------


def _stats_dict(stats: Any) -> dict[str, Any]:
    if hasattr(stats, "__dataclass_fields__"):
        return {k: v for k, v in asdict(stats).items() if isinstance(v, (int, float, str, bool, type(None)))}
    return dict(vars(stats)) if hasattr(stats, "__dict__") else {"repr": repr(stats)}


def _pad_id(config: Any) -> int:
    # Padding positions are masked out, so any valid id works; prefer the model's own.
    for attr in ("pad_token_id", "eos_token_id", "bos_token_id"):
        v = getattr(config, attr, None)
        if isinstance(v, list):
            v = v[0] if v else None
        if isinstance(v, int) and v >= 0:
            return v
    return 0


def special_token_ids(model_path: Path, config: Any) -> set[int]:
    ids: set[int] = set()
    for attr in ("pad_token_id", "eos_token_id", "bos_token_id"):
        v = getattr(config, attr, None)
        for x in v if isinstance(v, list) else [v]:
            if isinstance(x, int) and x >= 0:
                ids.add(x)
    try:  # the tokenizer may declare more specials (unk, added tokens); absent tokenizer is fine
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(model_path)
        ids.update(i for i in tok.all_special_ids if i is not None)
        ids.update(i for i, t in tok.added_tokens_decoder.items() if t.special)
    except Exception:
        pass
    return ids


def parse_bytes(text: str) -> int:
    m = re.fullmatch(r"\s*([0-9.]+)\s*([KMGT]?i?B?)\s*", text, re.IGNORECASE)
    if not m:
        raise argparse.ArgumentTypeError(f"not a byte size: {text!r} (e.g. 2GiB, 256MiB)")
    unit = m.group(2).upper().rstrip("B").rstrip("I")
    return int(float(m.group(1)) * 1024 ** " KMGT".index(unit or " "))


def kv_bytes_per_token(config: Any, dtype: torch.dtype) -> int:
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    elem = torch.empty((), dtype=dtype).element_size()
    return 2 * config.num_hidden_layers * kv_heads * head_dim * elem  # K and V, every layer


def ensure_checkpoint(args: argparse.Namespace) -> Path:
    if args.model:
        return Path(args.model)
    shape = {
        "hidden_size": args.hidden_size,
        "num_hidden_layers": args.num_layers,
        "num_attention_heads": args.num_heads,
        "num_key_value_heads": args.num_kv_heads,
        "intermediate_size": args.intermediate_size,
        "vocab_size": args.vocab_size,
    }
    # Key the cache on the shape so a smoke-test config never clobbers the benchmark model.
    key = hashlib.sha1(json.dumps(shape, sort_keys=True).encode()).hexdigest()[:10]
    path = CACHE_DIR / f"llama-h{args.hidden_size}-l{args.num_layers}-{key}"
    if (path / "config.json").exists() and any(path.glob("*.safetensors")):
        return path
    from pagefleet.engine.testing import make_tiny_checkpoint

    print(f"building checkpoint {path} ...", file=sys.stderr)
    return Path(make_tiny_checkpoint(path, "llama", seed=0, dtype=torch.float32, **shape))


def count_parameters(model_path: Path) -> int | None:
    """Parameter count from the safetensors headers (no weights loaded)."""
    try:
        from safetensors import safe_open

        total = 0
        for f in sorted(model_path.glob("*.safetensors")):
            with safe_open(f, framework="pt") as st:
                total += sum(math.prod(st.get_slice(k).get_shape()) for k in st.keys())
        return total or None
    except Exception:
        return None


def machine_info(threads: int) -> dict[str, Any]:
    cpu = "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    import transformers

    return {
        "cpu_model": cpu,
        "cpu_count": os.cpu_count(),
        "cpu_affinity": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "torch_threads": threads,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "hostname_hash": hashlib.sha1(platform.node().encode()).hexdigest()[:8],
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
        # Other jobs on the box show up here; ratios from one run are still comparable, absolutes are not.
        "loadavg_at_end": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
    }


def model_info(model_path: Path, config: Any, dtype: str) -> dict[str, Any]:
    """The model's shape for a result file (shared by every bench script)."""
    return {
        "path": str(model_path),
        "arch": getattr(config, "model_type", None),
        "num_parameters": count_parameters(model_path),
        "hidden_size": config.hidden_size,
        "num_hidden_layers": config.num_hidden_layers,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": getattr(config, "num_key_value_heads", None),
        "intermediate_size": getattr(config, "intermediate_size", None),
        "vocab_size": config.vocab_size,
        "dtype": dtype,
    }


def agreement(a: list[list[int]], b: list[list[int]]) -> dict[str, Any]:
    """How far two systems' greedy outputs agree (a sanity check, not a benchmark metric).

    With random weights, near-ties in the logits can flip the argmax between differently ordered float
    reductions, after which the sequences legitimately part; a long common prefix on most requests is what a
    correct engine looks like, an early divergence on many is a bug.
    """
    same, prefix_frac, diverged = 0, [], []
    for req, (x, y) in enumerate(zip(a, b, strict=True)):
        n = min(len(x), len(y))
        k = next((i for i in range(n) if x[i] != y[i]), n)
        same += x == y
        prefix_frac.append(k / max(1, max(len(x), len(y))))
        if x != y:
            diverged.append({"request": req, "first_diff_at": k, "len": max(len(x), len(y))})
    return {
        "identical": same,
        "of": len(a),
        "mean_common_prefix_frac": round(statistics.fmean(prefix_frac), 4),
        "diverged": diverged,
    }


# ----------------------------------------------------------------------------------------------------
# Main
# ----------------------------------------------------------------------------------------------------


def add_model_args(p: argparse.ArgumentParser) -> None:
    """The benchmark model's flags (every bench script builds the same ~125M Llama by default)."""
    g = p.add_argument_group("model (random weights, built once into bench/.cache/; shape flags are ignored "
                             "with --model)")
    g.add_argument("--model", help="use this existing HF checkpoint directory instead of building one")
    g.add_argument("--hidden-size", type=int, default=768, help="model width")
    g.add_argument("--num-layers", type=int, default=12, help="decoder layers")
    g.add_argument("--num-heads", type=int, default=12, help="attention heads")
    g.add_argument("--num-kv-heads", type=int, default=4, help="KV heads (grouped-query attention)")
    g.add_argument("--intermediate-size", type=int, default=2048, help="MLP width")
    g.add_argument("--vocab-size", type=int, default=32000, help="vocabulary size")
    g.add_argument("--dtype", choices=sorted(DTYPES), default="float32", help="weights and KV dtype for every system")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0] + " Prints a markdown table; writes a JSON result file.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    add_model_args(p)

    g = p.add_argument_group("workload (seeded; greedy; ignore_eos: every request generates exactly its length)")
    g.add_argument("--num-requests", type=int, default=64)
    g.add_argument("--min-prompt", type=int, default=32, help="clamped to --max-prompt")
    g.add_argument("--max-prompt", type=int, default=512, help="prompt lengths are uniform in [min, max]")
    g.add_argument("--min-output", type=int, default=32, help="clamped to --max-output")
    g.add_argument("--max-output", type=int, default=256, help="output lengths are uniform in [min, max]")
    g.add_argument("--seed", type=int, default=0)

    g = p.add_argument_group("run")
    g.add_argument(
        "--peers",
        default=",".join(ALL_SYSTEMS),
        help=f"comma-separated systems to run, from {','.join(ALL_SYSTEMS)}",
    )
    g.add_argument(
        "--threads",
        type=int,
        default=len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        help="torch.set_num_threads for all systems (default: usable cores)",
    )
    g.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="timed runs per system; with >1, all systems stay loaded and runs are interleaved (median reported)",
    )
    g.add_argument("--result-json", type=Path, default=DEFAULT_RESULT_JSON)

    g = p.add_argument_group("engine / cache settings (shared where both sides have the knob)")
    g.add_argument("--kv-budget", default="2GiB", help="KV cache bytes for ours and for generate_batch's num_blocks")
    g.add_argument(
        "--small-kv-budget",
        default="256MiB",
        help="a second, tight budget: ours runs the workload again under it to show peak concurrency ('' to skip)",
    )
    g.add_argument("--block-size", type=int, default=16, help="our KV block size (tokens)")
    g.add_argument(
        "--max-num-seqs",
        type=int,
        default=256,
        help="ours max_num_seqs = generate_batch max_requests_per_batch",
    )
    g.add_argument(
        "--max-batch-tokens",
        type=int,
        default=2048,
        help="ours max_num_batched_tokens = generate_batch max_batch_tokens",
    )
    g.add_argument(
        "--max-model-len",
        type=int,
        default=None,
        help="per-sequence reservation for the KV capacity comparison (default: min(2048, max_position_embeddings))",
    )
    g.add_argument("--hf-batch-size", type=int, default=16, help="static batch size for transformers generate")
    g.add_argument("--hf-attn", default="sdpa", help="attn_implementation for transformers generate")
    g.add_argument(
        "--cb-attn",
        default="sdpa",
        help="attn_implementation for continuous batching (CPU: 'sdpa' or 'paged|eager')",
    )
    g.add_argument("--cb-page-size", type=int, default=256, help="continuous batching page_size (its default: 256)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    systems = [s.strip() for s in args.peers.split(",") if s.strip()]
    unknown = set(systems) - set(ALL_SYSTEMS)
    if unknown:
        raise SystemExit(f"unknown system(s) in --peers: {sorted(unknown)}")
    load_at_start = list(os.getloadavg()) if hasattr(os, "getloadavg") else None
    # Shrinking only the max (a quick trial) should not require also lowering the min.
    args.min_prompt = min(args.min_prompt, args.max_prompt)
    args.min_output = min(args.min_output, args.max_output)
    torch.set_num_threads(args.threads)
    dtype = DTYPES[args.dtype]

    from transformers import AutoConfig

    model_path = ensure_checkpoint(args)
    config = AutoConfig.from_pretrained(model_path)
    bpt = kv_bytes_per_token(config, dtype)
    max_model_len = args.max_model_len or min(2048, getattr(config, "max_position_embeddings", 2048) or 2048)
    assert args.max_prompt + args.max_output <= max_model_len, "workload exceeds max_model_len"

    workload = make_workload(
        args.num_requests,
        (args.min_prompt, args.max_prompt),
        (args.min_output, args.max_output),
        config.vocab_size,
        special_token_ids(model_path, config),
        args.seed,
    )
    warm = warmup_workload(workload)
    budget = parse_bytes(args.kv_budget)

    def make(name: str):
        if name == "ours":
            return OursSystem(model_path, args, args.kv_budget)
        if name == "generate":
            return HFGenerateSystem(model_path, args)
        return HFContinuousBatchingSystem(model_path, args, budget, bpt)

    runs: dict[str, list[RunOutput]] = {s: [] for s in systems}
    errors: dict[str, str] = {}
    descriptions: dict[str, str] = {}

    def setup(sys_obj) -> bool:
        try:
            t0 = time.perf_counter()
            sys_obj.setup()
            load_s = time.perf_counter() - t0
            sys_obj.run(warm)
            print(f"[{sys_obj.name}] loaded in {load_s:.1f}s, warmed up", file=sys.stderr)
            return True
        except Exception:
            errors[sys_obj.name] = traceback.format_exc()
            print(f"[{sys_obj.name}] FAILED in setup/warm-up:\n{errors[sys_obj.name]}", file=sys.stderr)
            return False

    def timed(sys_obj) -> None:
        # torch's thread count is process-wide: re-assert it so no system inherits another's setting.
        torch.set_num_threads(args.threads)
        try:
            out = sys_obj.run(workload)
            out.extra["torch_threads_after_run"] = torch.get_num_threads()
        except Exception:
            errors[sys_obj.name] = traceback.format_exc()
            print(f"[{sys_obj.name}] FAILED:\n{errors[sys_obj.name]}", file=sys.stderr)
            return
        runs[sys_obj.name].append(out)
        print(f"[{sys_obj.name}] {out.wall_s:.1f}s", file=sys.stderr)

    def release(sys_obj) -> None:
        try:
            sys_obj.teardown()
        finally:
            gc.collect()

    if args.rounds == 1:
        # One resident system at a time keeps peak memory low on a shared machine.
        for name in systems:
            obj = make(name)
            descriptions[name] = obj.describe()
            if setup(obj):
                timed(obj)
            release(obj)
    else:
        objs = [make(n) for n in systems]
        live = []
        for obj in objs:
            descriptions[obj.name] = obj.describe()
            if setup(obj):
                live.append(obj)
        for _ in range(args.rounds):
            for obj in live:
                if obj.name not in errors:
                    timed(obj)
        for obj in live:
            release(obj)

    # Tight-budget run: does the paged cache keep many sequences running when memory is scarce?
    small_run = None
    if "ours" in systems and args.small_kv_budget and "ours" not in errors:
        obj = OursSystem(model_path, args, args.small_kv_budget)
        try:
            obj.setup()
            obj.run(warm)
            torch.set_num_threads(args.threads)
            small_run = obj.run(workload)
            print(f"[ours @ {args.small_kv_budget}] {small_run.wall_s:.1f}s", file=sys.stderr)
        except Exception:
            errors["ours_small_budget"] = traceback.format_exc()
            print(f"[ours @ {args.small_kv_budget}] FAILED:\n{errors['ours_small_budget']}", file=sys.stderr)
        finally:
            release(obj)

    result = summarize(args, model_path, config, workload, bpt, max_model_len, runs, small_run, errors, descriptions)
    result["machine"]["loadavg_at_start"] = load_at_start
    print(render_markdown(result))
    args.result_json.parent.mkdir(parents=True, exist_ok=True)
    args.result_json.write_text(json.dumps(result, indent=2) + "\n")
    print(f"\nresults written to {args.result_json}", file=sys.stderr)
    return 1 if errors else 0


def summarize(args, model_path, config, workload, bpt, max_model_len, runs, small_run, errors, descriptions):
    useful = workload.num_output_tokens
    rows: dict[str, dict[str, Any]] = {}
    for name, outs in runs.items():
        if not outs:
            continue
        wall = statistics.median(o.wall_s for o in outs)
        last = outs[-1]
        # A system only gets credit for requests it completed to their exact length.
        lens_ok = all(len(o) == n for o, n in zip(last.outputs, workload.output_lens, strict=True))
        rows[name] = {
            "useful_tokens": useful
            if lens_ok
            else sum(min(len(o), n) for o, n in zip(last.outputs, workload.output_lens, strict=True)),
            "raw_generated_tokens": last.raw_generated,
            "wall_s": round(wall, 3),
            "wall_s_all_rounds": [round(o.wall_s, 3) for o in outs],
            "output_lengths_exact": lens_ok,
            "extra": last.extra,
        }
        rows[name]["tokens_per_s"] = round(rows[name]["useful_tokens"] / wall, 2)
        rows[name]["raw_tokens_per_s"] = round(last.raw_generated / wall, 2)
    if "ours" in rows:
        for name, row in rows.items():
            if name != "ours":
                row["ours_over_peer"] = round(rows["ours"]["tokens_per_s"] / row["tokens_per_s"], 3)

    # Greedy outputs should largely agree across systems; a big disagreement means something is wrong.
    agree = {}
    names = [n for n in ALL_SYSTEMS if n in runs and runs[n]]
    for i, a in enumerate(names):
        for b in names[i + 1 :]:
            agree[f"{a}_vs_{b}"] = agreement(runs[a][-1].outputs, runs[b][-1].outputs)
    if small_run is not None and runs.get("ours"):
        # Preemption (recompute) under the tight budget must not change greedy outputs.
        agree["ours_vs_ours_small_kv_budget"] = agreement(runs["ours"][-1].outputs, small_run.outputs)

    capacity = kv_capacity(args, workload, bpt, max_model_len, runs.get("ours"), small_run)
    return {
        "benchmark": "offline_throughput",
        "command": " ".join(shlex.quote(x) for x in [".venv/bin/python", "bench/offline_throughput.py", *sys.argv[1:]]),
        "argv": sys.argv,
        "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "machine": machine_info(args.threads),
        "model": model_info(model_path, config, args.dtype),
        "workload": {
            "num_requests": len(workload.prompts),
            "prompt_len_range": [args.min_prompt, args.max_prompt],
            "output_len_range": [args.min_output, args.max_output],
            "seed": args.seed,
            "prompt_tokens": workload.num_prompt_tokens,
            "output_tokens": workload.num_output_tokens,
            "greedy": True,
            "ignore_eos": True,
        },
        "systems": descriptions,
        "results": rows,
        "output_agreement": agree,
        "kv_capacity": capacity,
        "errors": errors,
    }


def kv_capacity(args, workload, bpt, max_model_len, ours_runs, small_run) -> dict[str, Any]:
    """Sequences that fit in a KV budget: paged blocks (ours, measured) vs max_model_len per sequence."""
    bs = args.block_size
    # What this workload's sequences need at their largest (prompt + all output), rounded up to whole blocks.
    final_blocks = [math.ceil((len(p) + n) / bs) for p, n in zip(workload.prompts, workload.output_lens, strict=True)]
    mean_final_tokens = statistics.fmean(final_blocks) * bs
    budgets = []
    for label, run in (
        (args.kv_budget, ours_runs[-1] if ours_runs else None),
        (args.small_kv_budget, small_run),
    ):
        if not label:
            continue
        nbytes = parse_bytes(label)
        entry: dict[str, Any] = {
            "budget": label,
            "budget_bytes": nbytes,
            "reserved_max_model_len_seqs": nbytes // (max_model_len * bpt),
            "budget_tokens_theoretical": nbytes // bpt,
        }
        if run is not None:
            st = run.extra.get("stats", {})
            nb, bsz = st.get("num_blocks"), st.get("block_size", bs)
            if nb is not None:
                entry["ours_num_blocks"] = nb
                entry["ours_block_tokens"] = nb * bsz
                # How many sequences of this workload's (mean) final size the pool holds simultaneously.
                entry["ours_seqs_fit_at_mean_final_len"] = int(nb * bsz // mean_final_tokens)
            entry["ours_peak_num_running"] = run.extra.get("peak_num_running")
            entry["ours_num_preemptions"] = run.extra.get("num_preemptions")
            entry["ours_tokens_per_s"] = round(sum(workload.output_lens) / run.wall_s, 2)
            entry["ours_wall_s"] = round(run.wall_s, 3)
        budgets.append(entry)
    return {
        "bytes_per_token": bpt,
        "max_model_len": max_model_len,
        "block_size": bs,
        "workload_mean_final_len_tokens": round(mean_final_tokens, 1),
        "num_requests": len(workload.prompts),
        "max_num_seqs": args.max_num_seqs,
        "budgets": budgets,
    }


def render_markdown(r: dict[str, Any]) -> str:
    m, w, md, c = r["machine"], r["workload"], r["model"], r["kv_capacity"]
    load = ""
    if m.get("loadavg_at_start") and m.get("loadavg_at_end"):
        start, end = m["loadavg_at_start"][0], m["loadavg_at_end"][0]
        load = f"; 1-min load average {start:.1f} at start, {end:.1f} at end"
    n = md.get("num_parameters")
    params = f"{n / 1e6:.{0 if n >= 1e7 else 2}f}M params, " if n else ""
    lines = [
        "## Offline throughput",
        "",
        f"Command: `{r['command']}`",
        "",
        f"Machine: {m['cpu_model']}, {m['cpu_affinity'] or m['cpu_count']} usable cores, "
        f"torch {m['torch']} ({m['torch_threads']} threads, OMP_WAIT_POLICY={m['omp_wait_policy']}), "
        f"transformers {m['transformers']}{load}",
        "",
        f"Model: {md['arch']}, {params}hidden {md['hidden_size']}, {md['num_hidden_layers']} layers, "
        f"{md['num_attention_heads']} heads / {md['num_key_value_heads']} KV heads, "
        f"vocab {md['vocab_size']}, {md['dtype']}, random weights",
        "",
        f"Workload: {w['num_requests']} requests, "
        f"prompt {w['prompt_len_range'][0]}-{w['prompt_len_range'][1]} ({w['prompt_tokens']} tokens), "
        f"output {w['output_len_range'][0]}-{w['output_len_range'][1]} ({w['output_tokens']} tokens), "
        f"greedy, ignore_eos, seed {w['seed']}",
        "",
        "| system | useful generated tokens | raw generated tokens | wall s | tokens/s | ours / peer |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for name in ALL_SYSTEMS:
        row = r["results"].get(name)
        if row is None:
            if name in r["errors"]:
                lines.append(f"| {name} | failed (see errors) | | | | |")
            continue
        if name == "ours":
            ratio = "1.00"
        else:
            ratio = f"{row['ours_over_peer']:.2f}x" if "ours_over_peer" in row else "-"
        flag = "" if row["output_lengths_exact"] else " (lengths wrong!)"
        cells = [
            f"{name}{flag}",
            row["useful_tokens"],
            row["raw_generated_tokens"],
            f"{row['wall_s']:.2f}",
            f"{row['tokens_per_s']:.1f}",
            ratio,
        ]
        lines.append("| " + " | ".join(str(x) for x in cells) + " |")
    lines += ["", "Systems:"]
    lines += [f"- `{k}`: {v}" for k, v in r["systems"].items()]
    if r["output_agreement"]:
        lines += ["", "Greedy output agreement (sanity check; random weights make near-ties common):"]
        for k, v in r["output_agreement"].items():
            prefix = v["mean_common_prefix_frac"]
            lines.append(f"- {k}: {v['identical']}/{v['of']} identical, mean common prefix {prefix:.0%}")
    lines += [
        "",
        f"KV capacity ({c['bytes_per_token']} bytes/token; reserving max_model_len={c['max_model_len']} "
        f"per sequence vs {c['block_size']}-token blocks; workload mean final length "
        f"{c['workload_mean_final_len_tokens']} tokens, {c['num_requests']} requests, "
        f"max_num_seqs {c['max_num_seqs']}):",
        "",
        "| KV budget | seqs if reserving max_model_len | ours: blocks (tokens) "
        "| ours: seqs that fit at mean final len | ours: peak running (measured) | preemptions "
        "| ours tokens/s |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for b in c["budgets"]:
        cells = [
            b["budget"],
            b["reserved_max_model_len_seqs"],
            f"{b['ours_num_blocks']} ({b['ours_block_tokens']})" if "ours_num_blocks" in b else "-",
            b.get("ours_seqs_fit_at_mean_final_len", "-"),
            b.get("ours_peak_num_running", "-"),
            b.get("ours_num_preemptions", "-"),
            b.get("ours_tokens_per_s", "-"),
        ]
        lines.append("| " + " | ".join(str(x) for x in cells) + " |")
    if r["errors"]:
        lines += ["", "Errors:"]
        for k, v in r["errors"].items():
            lines.append(f"- {k}: {v.strip().splitlines()[-1]}")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
