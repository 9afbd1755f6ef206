"""The `pagefleet` command: the one place that wires components together.

Subcommands arrive with their issues (engine, router, operator, up, bench, crd,
models); each imports its component only when it runs, so `pagefleet --help`
stays fast and the operator package never imports engine internals.
"""

from __future__ import annotations

import argparse
import sys

from pagefleet import __version__


def _generate(args: argparse.Namespace) -> int:
    from pagefleet.engine import LLM, SamplingParams

    llm = LLM(model=args.model, dtype=args.dtype, block_size=args.block_size,
              kv_cache_memory=args.kv_cache_memory, max_num_seqs=args.max_num_seqs,
              max_num_batched_tokens=args.max_num_batched_tokens, max_model_len=args.max_model_len)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed)
    for out in llm.generate(args.prompt, params):
        print(out.outputs[0].text)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pagefleet",
        description="pagefleet: serve LLMs with a paged-KV engine, a prefix-aware router and a "
                    "Kubernetes operator. Run `pagefleet COMMAND --help` for a command's options.")
    parser.add_argument("--version", action="version", version=f"pagefleet {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    gen = sub.add_parser("generate", help="generate text offline for one or more prompts",
                         description="Load a model into one in-process engine and print a completion for "
                                     "each prompt (greedy by default).")
    gen.add_argument("prompt", nargs="+", help="prompt text (one completion per prompt)")
    gen.add_argument("--model", required=True,
                     help="directory with an HF config.json, *.safetensors weights and a tokenizer")
    gen.add_argument("--dtype", default="auto",
                     help="float32 | bfloat16 | float16 | auto (default: bf16 where the CPU has native "
                          "bf16, else fp32; on GPU the checkpoint's dtype)")
    gen.add_argument("--block-size", type=int, default=16, help="tokens per KV-cache block (default 16)")
    gen.add_argument("--kv-cache-memory", default="2GiB",
                     help="KV cache budget, e.g. 512MiB or 2GiB (default 2GiB)")
    gen.add_argument("--max-num-seqs", type=int, default=256, help="max concurrent sequences (default 256)")
    gen.add_argument("--max-num-batched-tokens", type=int, default=2048,
                     help="token budget per engine step; longer prompts are prefilled in chunks (default 2048)")
    gen.add_argument("--max-model-len", type=int, default=None,
                     help="max prompt + output tokens (default: the model's context length, capped by the "
                          "KV budget)")
    gen.add_argument("--max-tokens", type=int, default=64, help="tokens to generate per prompt (default 64)")
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    gen.add_argument("--seed", type=int, default=None, help="per-request sampling seed")
    gen.set_defaults(func=_generate)
    return parser


def main(argv: list[str] | None = None) -> int:
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
