"""Spec -> what to run: pure functions shared by the Kubernetes renderer and the
local orchestrator (`pagefleet up`), so both start engines and routers with
the same command lines."""

from __future__ import annotations

from pagefleet.operator.spec import InferenceServiceSpec


def engine_args(spec: InferenceServiceSpec, served_name: str, host: str, port: int) -> list[str]:
    """`pagefleet engine ...` arguments (without the executable) for one replica."""
    e = spec.engine
    args = ["engine", "--model", spec.model.uri, "--served-model-name", served_name, "--host", host,
            "--port", str(port), "--dtype", e.dtype, "--block-size", str(e.block_size),
            "--kv-cache-memory", e.kv_cache_memory, "--max-num-seqs", str(e.max_num_seqs),
            "--max-num-batched-tokens", str(e.max_num_batched_tokens),
            "--shutdown-timeout", str(e.shutdown_timeout_seconds)]
    if e.max_model_len is not None:
        args += ["--max-model-len", str(e.max_model_len)]
    if not e.prefix_caching:
        args.append("--no-prefix-caching")
    if e.max_queue is not None:
        args += ["--max-queue", str(e.max_queue)]
    if e.threads is not None:
        args += ["--threads", str(e.threads)]
    return args + list(e.extra_args)


def router_args(spec: InferenceServiceSpec, served_name: str, pool: str, discovery: list[str], host: str,
                port: int) -> list[str]:
    """`pagefleet router ...` arguments; `discovery` is the pool's discovery flags
    (e.g. ["--endpoints-file", "main=/path"] or ["--k8s-service", "main=ns/svc"])."""
    r = spec.router
    return ["router", "--pool", f"{pool}={served_name}", *discovery, "--tokenizer", f"{pool}={spec.model.uri}",
            "--policy", r.policy, "--prefix-weight", str(r.prefix_weight),
            "--prefix-weight-per-load", str(r.prefix_weight_per_load), "--load-cap-ratio", str(r.load_cap_ratio),
            "--load-cap-slack", str(r.load_cap_slack), "--session-header", r.session_header,
            "--host", host, "--port", str(port)]
