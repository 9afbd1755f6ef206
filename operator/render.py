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
    if e.quantization != "none":
        args += ["--quantization", e.quantization]
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


# ---- Kubernetes objects -------------------------------------------------------------------------------

ENGINE_PORT = 8000
ROUTER_PORT = 8080
CACHE_MOUNT = "/cache"
MODELS_MOUNT = "/models"
USER_ID = 10001  # the image's non-root user (a high UID: no clash with host users)
ROUTER_RESOURCES = {"requests": {"cpu": "100m", "memory": "512Mi"}, "limits": {"memory": "1Gi"}}


def labels(name: str, component: str, pool: str | None = None) -> dict[str, str]:
    out = {"app.kubernetes.io/name": "pagefleet", "app.kubernetes.io/instance": name,
           "app.kubernetes.io/component": component, "app.kubernetes.io/managed-by": "pagefleet-operator"}
    if pool is not None:
        out["pagefleet.dev/pool"] = pool
    return out


def pod_selector(name: str, component: str, pool: str | None = None) -> dict[str, str]:
    return {k: v for k, v in labels(name, component, pool).items() if k != "app.kubernetes.io/managed-by"}


def object_names(name: str, spec: InferenceServiceSpec) -> dict[str, str]:
    """Names of the children, for the handlers and the autoscaler."""
    out = {"router": f"{name}-router", "service": name, "config": f"{name}-config", "cache": f"{name}-model-cache"}
    out.update({f"pool:{p.name}": f"{name}-{p.name}" for p in spec.pools})
    return out


_CONTAINER_SECURITY = {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
                       "runAsNonRoot": True, "capabilities": {"drop": ["ALL"]}}
_POD_SECURITY = {"runAsNonRoot": True, "runAsUser": USER_ID, "runAsGroup": USER_ID, "fsGroup": USER_ID,
                 "seccompProfile": {"type": "RuntimeDefault"}}


def _model_volumes(name: str, spec: InferenceServiceSpec, read_only: bool) -> tuple[list[dict], list[dict]]:
    """(volumes, mounts): the model's PVC at /models, or the shared download cache at /cache;
    plus a writable /tmp (the root filesystem is read-only)."""
    volumes = [{"name": "tmp", "emptyDir": {}}]
    mounts = [{"name": "tmp", "mountPath": "/tmp"}]
    if spec.model.pvc:
        volumes.append({"name": "models", "persistentVolumeClaim": {"claimName": spec.model.pvc, "readOnly": True}})
        mounts.append({"name": "models", "mountPath": MODELS_MOUNT, "readOnly": True})
    if needs_cache(spec):
        volumes.append({"name": "cache", "persistentVolumeClaim": {"claimName": f"{name}-model-cache"}})
        mounts.append({"name": "cache", "mountPath": CACHE_MOUNT, "readOnly": read_only})
    return volumes, mounts


def needs_cache(spec: InferenceServiceSpec) -> bool:
    return spec.model.uri.startswith(("pagefleet://", "hf://"))


def _env(spec: InferenceServiceSpec) -> list[dict]:
    env = [{"name": "PAGEFLEET_CACHE", "value": CACHE_MOUNT}, {"name": "HF_HOME", "value": f"{CACHE_MOUNT}/hf"}]
    return env + list(spec.engine.env)


def _pod_spec(spec: InferenceServiceSpec, containers: list[dict], volumes: list[dict], grace: int,
              service_account: str | None = None) -> dict:
    pod = {"securityContext": _POD_SECURITY, "terminationGracePeriodSeconds": grace,
           "containers": containers, "volumes": volumes, "automountServiceAccountToken": service_account is not None}
    if service_account:
        pod["serviceAccountName"] = service_account
    if spec.engine.node_selector:
        pod["nodeSelector"] = dict(spec.engine.node_selector)
    if spec.engine.tolerations:
        pod["tolerations"] = list(spec.engine.tolerations)
    return pod


def _deployment(name: str, namespace: str, instance: str, component: str, pool: str | None, replicas: int,
                pod: dict) -> dict:
    return {
        "apiVersion": "apps/v1", "kind": "Deployment",
        "metadata": {"name": name, "namespace": namespace, "labels": labels(instance, component, pool)},
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": pod_selector(instance, component, pool)},
            # a new replica must be ready before an old one goes: capacity never dips during a rollout
            "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": 0, "maxSurge": 1}},
            "template": {"metadata": {"labels": labels(instance, component, pool)}, "spec": pod},
        },
    }


def _http_probe(path: str, period: int, failures: int) -> dict:
    return {"httpGet": {"path": path, "port": "http"}, "periodSeconds": period, "failureThreshold": failures}


def render_objects(name: str, namespace: str, spec: InferenceServiceSpec, served_name: str,
                   replicas: dict[str, int] | None = None) -> list[dict]:
    """Every child object of an InferenceService, without owner references (the handler
    adopts them). `replicas` carries the autoscaler's current counts per pool, so a spec
    update never resets them; absent pools start at minReplicas."""
    replicas = replicas or {}
    names = object_names(name, spec)
    e = spec.engine
    grace = e.shutdown_timeout_seconds + 10  # preStop pause + drain, then SIGKILL
    objs: list[dict] = [{
        "apiVersion": "v1", "kind": "ConfigMap",
        "metadata": {"name": names["config"], "namespace": namespace, "labels": labels(name, "config")},
        "data": {"inferenceservice.json": spec.model_dump_json(by_alias=True, indent=2)},
    }]
    if needs_cache(spec):
        claim = {"accessModes": ["ReadWriteMany"], "resources": {"requests": {"storage": spec.model.cache.size}}}
        if spec.model.cache.storage_class_name:
            claim["storageClassName"] = spec.model.cache.storage_class_name
        objs.append({"apiVersion": "v1", "kind": "PersistentVolumeClaim",
                     "metadata": {"name": names["cache"], "namespace": namespace, "labels": labels(name, "cache")},
                     "spec": claim})
    for pool in spec.pools:
        pool_name = names[f"pool:{pool.name}"]
        volumes, mounts = _model_volumes(name, spec, read_only=False)
        container = {
            "name": "engine", "image": e.image, "imagePullPolicy": e.image_pull_policy,
            "command": ["pagefleet"], "args": engine_args(spec, served_name, "0.0.0.0", ENGINE_PORT),
            "env": _env(spec), "ports": [{"name": "http", "containerPort": ENGINE_PORT, "protocol": "TCP"}],
            # /health is 503 while the model loads: ready only then; alive as long as the server answers
            "readinessProbe": _http_probe("/health", 5, 2),
            "livenessProbe": {"tcpSocket": {"port": "http"}, "periodSeconds": 10, "failureThreshold": 6},
            # SIGTERM only once endpoint removal has reached the routers; the engine then drains
            "lifecycle": {"preStop": {"sleep": {"seconds": 5}}},
            "securityContext": _CONTAINER_SECURITY, "volumeMounts": mounts,
        }
        if e.resources:
            container["resources"] = dict(e.resources)
        count = replicas.get(pool.name, pool.autoscaling.min_replicas)
        objs.append(_deployment(pool_name, namespace, name, "engine", pool.name, count,
                                _pod_spec(spec, [container], volumes, grace)))
        objs.append({
            "apiVersion": "v1", "kind": "Service",
            "metadata": {"name": pool_name, "namespace": namespace, "labels": labels(name, "engine", pool.name)},
            "spec": {"clusterIP": "None", "selector": pod_selector(name, "engine", pool.name),
                     "ports": [{"name": "http", "port": ENGINE_PORT, "targetPort": "http", "protocol": "TCP"}]},
        })
    # the router: one pool per InferenceService (validated by the handler), discovered from its headless Service
    pool = spec.pools[0]
    volumes, mounts = _model_volumes(name, spec, read_only=True)
    router = {
        "name": "router", "image": e.image, "imagePullPolicy": e.image_pull_policy, "command": ["pagefleet"],
        "args": router_args(spec, served_name, pool.name,
                            ["--k8s-service", f"{pool.name}={namespace}/{names[f'pool:{pool.name}']}:http"],
                            "0.0.0.0", ROUTER_PORT),
        "env": _env(spec), "ports": [{"name": "http", "containerPort": ROUTER_PORT, "protocol": "TCP"}],
        "readinessProbe": _http_probe("/health", 5, 2),
        "livenessProbe": {"tcpSocket": {"port": "http"}, "periodSeconds": 10, "failureThreshold": 6},
        "securityContext": _CONTAINER_SECURITY, "volumeMounts": mounts,
    }
    # The router holds a tokenizer and per-replica indexes (~350 MB resident with a 150k-token
    # vocabulary): sized by default so it is neither starved nor unbounded.
    router["resources"] = dict(spec.router.resources) if spec.router.resources else ROUTER_RESOURCES
    objs += [
        {"apiVersion": "v1", "kind": "ServiceAccount",
         "metadata": {"name": names["router"], "namespace": namespace, "labels": labels(name, "router")}},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role",
         "metadata": {"name": names["router"], "namespace": namespace, "labels": labels(name, "router")},
         "rules": [{"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"],
                    "verbs": ["list", "watch"]}]},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
         "metadata": {"name": names["router"], "namespace": namespace, "labels": labels(name, "router")},
         "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": names["router"]},
         "subjects": [{"kind": "ServiceAccount", "name": names["router"], "namespace": namespace}]},
        _deployment(names["router"], namespace, name, "router", None, spec.router.replicas,
                    _pod_spec(spec, [router], volumes, 40, service_account=names["router"])),
        {"apiVersion": "v1", "kind": "Service",
         "metadata": {"name": names["service"], "namespace": namespace, "labels": labels(name, "router")},
         "spec": {"type": "ClusterIP", "selector": pod_selector(name, "router"),
                  "ports": [{"name": "http", "port": 80, "targetPort": "http", "protocol": "TCP"}]}},
    ]
    return objs
