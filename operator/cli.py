"""The `pagefleet` command: the one place that wires components together.

Subcommands arrive with their issues (engine, router, operator, up, bench, crd,
models); each imports its component only when it runs, so `pagefleet --help`
stays fast and the operator package never imports engine internals.
"""

from __future__ import annotations

import argparse
import os
import sys

from pagefleet import __version__


def _engine_config(args: argparse.Namespace):
    from pagefleet.engine.config import EngineConfig

    return EngineConfig(model=args.model, dtype=args.dtype, block_size=args.block_size,
                        kv_cache_memory=args.kv_cache_memory, max_num_seqs=args.max_num_seqs,
                        max_num_batched_tokens=args.max_num_batched_tokens, max_model_len=args.max_model_len,
                        enable_prefix_caching=not args.no_prefix_caching, num_threads=args.threads,
                        served_model_name=getattr(args, "served_model_name", None))


def _generate(args: argparse.Namespace) -> int:
    from pagefleet.engine import LLM, SamplingParams

    llm = LLM.from_config(_engine_config(args))
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed)
    for out in llm.generate(args.prompt, params):
        print(out.outputs[0].text)
    return 0


def _engine(args: argparse.Namespace) -> int:
    import logging

    from pagefleet.engine.llm_engine import LLMEngine
    from pagefleet.engine.server import serve

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    config = _engine_config(args)
    name = args.served_model_name or args.model
    config.served_model_name = name
    return serve(lambda: LLMEngine(config), name, args.host, args.port, max_queue=args.max_queue,
                 shutdown_timeout=args.shutdown_timeout)


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True,
                   help="directory with an HF config.json, *.safetensors weights and a tokenizer")
    p.add_argument("--dtype", default="auto",
                   help="float32 | bfloat16 | float16 | auto (default: bf16 where the CPU has native "
                        "bf16, else fp32; on GPU the checkpoint's dtype)")
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV-cache block (default 16)")
    p.add_argument("--kv-cache-memory", default="2GiB", help="KV cache budget, e.g. 512MiB or 2GiB (default 2GiB)")
    p.add_argument("--max-num-seqs", type=int, default=256, help="max concurrent sequences (default 256)")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048,
                   help="token budget per engine step; longer prompts are prefilled in chunks (default 2048)")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="max prompt + output tokens (default: the model's context length, capped by the KV budget)")
    p.add_argument("--no-prefix-caching", action="store_true", help="disable reuse of KV blocks across requests")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: physical cores)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pagefleet",
        description="pagefleet: serve LLMs with a paged-KV engine, a prefix-aware router and a "
                    "Kubernetes operator. Run `pagefleet COMMAND --help` for a command's options.")
    parser.add_argument("--version", action="version", version=f"pagefleet {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    eng = sub.add_parser("engine", help="serve one engine replica over an OpenAI-compatible HTTP API",
                         description="Serve one model with the OpenAI API (/v1/completions, /v1/chat/completions, "
                                     "/v1/models), /health and Prometheus /metrics. SIGTERM drains in-flight "
                                     "requests before exiting.")
    _add_engine_args(eng)
    eng.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1; 0.0.0.0 in a pod)")
    eng.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    eng.add_argument("--served-model-name", default=None,
                     help="the name clients send as `model` (default: the --model value)")
    eng.add_argument("--max-queue", type=int, default=None,
                     help="answer 429 when more than this many requests are waiting (default: unbounded)")
    eng.add_argument("--shutdown-timeout", type=float, default=30.0,
                     help="seconds SIGTERM waits for in-flight requests before exiting (default 30)")
    eng.set_defaults(func=_engine)

    gen = sub.add_parser("generate", help="generate text offline for one or more prompts",
                         description="Load a model into one in-process engine and print a completion for "
                                     "each prompt (greedy by default).")
    gen.add_argument("prompt", nargs="+", help="prompt text (one completion per prompt)")
    _add_engine_args(gen)
    gen.add_argument("--max-tokens", type=int, default=64, help="tokens to generate per prompt (default 64)")
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    gen.add_argument("--seed", type=int, default=None, help="per-request sampling seed")
    gen.set_defaults(func=_generate)
    return parser


def main(argv: list[str] | None = None) -> int:
    # Before torch loads OpenMP: idle OpenMP workers sleep instead of spinning. The
    # engine shares its cores with the HTTP event loop (and, in a pod, a CPU quota
    # that spinning burns); measured on shared 2-core machines, spinning workers made
    # small matmuls 10-30x slower. An explicit OMP_WAIT_POLICY still wins.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 0
    try:
        return args.func(args)
    except ValueError as e:
        print(f"pagefleet: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
