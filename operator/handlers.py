"""kopf handlers: InferenceService -> child objects, status, and the autoscaler.

The handlers stay thin. Everything that decides something is a pure function
in this module (validation, replica carry-over, patch bodies, conditions,
status) or in `render.py` / `autoscale.py`, and is unit-tested on its own.

- create/update/resume -> `reconcile`: validate the spec. A bad one gets
  Ready=False/Degraded=True with the reason (InvalidSpec, Unsupported) and a
  Warning event, no child objects, and no retry: only editing the spec fixes
  it, and that triggers the next reconcile. A good one is rendered, owned
  (controller ownerReferences: deleting the InferenceService cascades to the
  children through the garbage collector) and applied: created when missing,
  else JSON-merge-patched, skipped when nothing differs. Engine Deployments
  keep the replica count they have (the autoscaler's), clamped to the pool's
  bounds, so a spec update never resets it. An object the API server rejects
  (400/422) is reported like a bad spec (ApplyFailed); other API errors are
  retried after 10 s.
- `autoscale` (a kopf timer, PAGEFLEET_AUTOSCALE_INTERVAL seconds, default
  15): per pool, scrape the ready pods' /metrics, `decide`, patch only the
  owned Deployment's spec.replicas (never the user's spec: GitOps stays
  drift-free), record the decision in status.pools[pool].lastScaling and a
  Normal "Scaled" event. It also refreshes readiness from the Deployments'
  status.readyReplicas. A reconcile and a tick of the same object never
  interleave (a lock in the object's memo).

API access: kubernetes_asyncio with a private Configuration loaded the way
kopf's own default login (`kopf.login_via_async_client`) loads it: in-cluster
service account first, then the kubeconfig ($KUBECONFIG or ~/.kube/config).
Calls are raw JSON (render.py makes plain dicts; typed models would only add
conversions).

Finalizers: no on.delete handler is registered, but kopf puts its finalizer
(`pagefleet.dev/finalizer`) on every object that has a timer, so that it can
stop the timer before the object goes, and removes it on deletion; deletion
then completes and the children follow through their ownerReferences.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import logging
import os
import time
from collections.abc import AsyncIterator, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import httpx
import kopf
from kubernetes_asyncio import client, config
from kubernetes_asyncio.client.exceptions import ApiException
from pydantic import ValidationError

from pagefleet.operator.autoscale import PodMetrics, decide, parse_pod_metrics
from pagefleet.operator.render import ENGINE_PORT, object_names, pod_selector, render_objects
from pagefleet.operator.spec import GROUP, PLURAL, VERSION, InferenceServiceSpec, cluster_problems, unsupported_features

AUTOSCALE_INTERVAL = float(os.environ.get("PAGEFLEET_AUTOSCALE_INTERVAL", "15"))
SCRAPE_TIMEOUT_S = 2.0
CONDITION_TYPES = ("Ready", "EnginesReady", "RouterReady", "Progressing", "Degraded")
FINALIZER = f"{GROUP}/finalizer"

log = logging.getLogger(__name__)


# ---- pure helpers ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Problem:
    """Why a spec is not applied: `reason` is InvalidSpec, Unsupported or ApplyFailed."""
    reason: str
    message: str


class Condition(NamedTuple):
    type: str
    status: str  # "True" | "False" | "Unknown"
    reason: str
    message: str


class Replicas(NamedTuple):
    desired: int
    ready: int


def _loc(loc: Sequence[int | str]) -> str:
    out = "spec"
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else f".{part}"
    return out


def check_spec(raw: Mapping[str, Any]) -> tuple[InferenceServiceSpec | None, Problem | None]:
    """The parsed spec, or why it cannot be applied (users read the message in `kubectl describe`)."""
    try:
        spec = InferenceServiceSpec.model_validate(dict(raw))
    except ValidationError as e:
        return None, Problem("InvalidSpec", "; ".join(f"{_loc(err['loc'])}: {err['msg']}" for err in e.errors()))
    if problems := cluster_problems(spec):
        return None, Problem("InvalidSpec", "; ".join(problems))
    unsupported = unsupported_features(spec)
    if len(spec.pools) > 1:
        unsupported.append("the router serves one pool per InferenceService for now")
    if unsupported:
        return None, Problem("Unsupported", "not implemented yet: " + "; ".join(unsupported))
    return spec, None


def carried_replicas(spec: InferenceServiceSpec, current: Mapping[str, int | None]) -> dict[str, int]:
    """Replicas per pool for `render_objects`: what the engine Deployments have now (the autoscaler set it),
    clamped to the pool's bounds; pools without a Deployment yet start at minReplicas."""
    out = {}
    for pool in spec.pools:
        lo, hi = pool.autoscaling.min_replicas, pool.autoscaling.max_replicas
        n = current.get(pool.name)
        out[pool.name] = lo if n is None else min(max(n, lo), hi)
    return out


def contains(actual: Any, desired: Any) -> bool:
    """Whether `actual` already has everything `desired` sets. The API server adds defaults (dict keys, fields
    inside list items), so dicts compare by subset and lists item by item."""
    if isinstance(desired, Mapping):
        return isinstance(actual, Mapping) and all(k in actual and contains(actual[k], v) for k, v in desired.items())
    if isinstance(desired, list):
        return (isinstance(actual, list) and len(actual) == len(desired)
                and all(contains(a, d) for a, d in zip(actual, desired, strict=True)))
    return actual == desired


def patch_for(desired: Mapping[str, Any], existing: Mapping[str, Any]) -> dict[str, Any] | None:
    """The JSON merge patch that brings `existing` to `desired`, or None when nothing differs.

    Only the fields we render are sent, so fields others own (status, defaults, annotations) stay. A merge patch
    replaces lists whole: containers, args and env come out exactly as rendered. Owner references of other
    owners are kept. A PersistentVolumeClaim's spec is left alone: it is immutable once bound (size can only
    grow), so a changed cache size only applies to a new claim.
    """
    body = {k: v for k, v in desired.items() if k not in ("apiVersion", "kind", "metadata", "status")}
    if desired.get("kind") == "PersistentVolumeClaim":
        body = {}
    meta = desired.get("metadata", {})
    body["metadata"] = {k: meta[k] for k in ("labels", "annotations") if k in meta}
    if "ownerReferences" in meta:
        ours = {r.get("uid") for r in meta["ownerReferences"]}
        others = [r for r in existing.get("metadata", {}).get("ownerReferences") or [] if r.get("uid") not in ours]
        body["metadata"]["ownerReferences"] = others + list(meta["ownerReferences"])
    return None if contains(existing, body) else body


def deployment_replicas(dep: Mapping[str, Any] | None) -> Replicas | None:
    if dep is None:
        return None
    desired = dep.get("spec", {}).get("replicas")
    return Replicas(1 if desired is None else int(desired), int(dep.get("status", {}).get("readyReplicas") or 0))


def ready_pod_ips(pods: Iterable[Mapping[str, Any]]) -> list[str]:
    """IPs of the pods that take traffic: Ready, not terminating. Pods that are starting have no load to report,
    and terminating ones are draining; `decide` counts the missing ones as idle."""
    out = []
    for pod in pods:
        status = pod.get("status") or {}
        ready = any(c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions") or [])
        if ready and status.get("podIP") and not pod.get("metadata", {}).get("deletionTimestamp"):
            out.append(status["podIP"])
    return out


def _summary(pools: Mapping[str, Replicas]) -> str:
    return ", ".join(f"{name}: {r.ready}/{r.desired} ready" for name, r in pools.items())


def serving_conditions(pools: Mapping[str, Replicas | None], router: Replicas | None) -> list[Condition]:
    """Conditions of an applied spec. EnginesReady: every pool has a ready replica (the router can serve it).
    Progressing: some Deployment has fewer ready replicas than it wants (starting, rolling out, scaling up).
    Degraded is for what the operator cannot fix by waiting (a spec it cannot apply), so False here."""
    known = {name: r or Replicas(0, 0) for name, r in pools.items()}
    idle = [name for name, r in known.items() if r.ready < 1]
    engines = (Condition("EnginesReady", "True", "PoolsServing", _summary(known)) if not idle else
               Condition("EnginesReady", "False", "NoReadyReplicas", f"no ready engine in {', '.join(idle)} "
                                                                      f"({_summary(known)})"))
    rr = router or Replicas(0, 0)
    router_msg = f"{rr.ready}/{rr.desired} router replicas ready"
    router_cond = (Condition("RouterReady", "True", "RouterServing", router_msg) if rr.ready >= 1 else
                   Condition("RouterReady", "False", "RouterNotReady", router_msg))
    if engines.status == "True" and router_cond.status == "True":
        ready = Condition("Ready", "True", "Serving", "the router and every pool have ready replicas")
    elif engines.status != "True":
        ready = Condition("Ready", "False", "EnginesNotReady", engines.message)
    else:
        ready = Condition("Ready", "False", "RouterNotReady", router_msg)
    behind = {name: r for name, r in {**known, "router": rr}.items() if r.ready < r.desired}
    progressing = (Condition("Progressing", "True", "ReplicasStarting", _summary(behind)) if behind else
                   Condition("Progressing", "False", "Stable", "every replica is ready"))
    degraded = Condition("Degraded", "False", "AsExpected", "the spec is applied")
    return [ready, engines, router_cond, progressing, degraded]


def problem_conditions(problem: Problem, previous: Sequence[Mapping[str, Any]] | None) -> list[Condition]:
    """Conditions of a spec that is not applied. Children of an earlier good spec keep running, so the
    Engines/RouterReady conditions keep their last value."""
    old = {c.get("type"): c for c in previous or ()}

    def kept(kind: str) -> Condition:
        c = old.get(kind)
        if c is None:
            return Condition(kind, "Unknown", problem.reason, "the spec is not applied")
        return Condition(kind, c.get("status", "Unknown"), c.get("reason", ""), c.get("message", ""))

    return [Condition("Ready", "False", problem.reason, problem.message), kept("EnginesReady"), kept("RouterReady"),
            Condition("Progressing", "False", problem.reason, "fix the spec to continue"),
            Condition("Degraded", "True", problem.reason, problem.message)]


def merge_conditions(previous: Sequence[Mapping[str, Any]] | None, new: Iterable[Condition],
                     now: str) -> list[dict[str, Any]]:
    """The full conditions list (a merge patch replaces lists): lastTransitionTime moves only when a
    condition's status changes."""
    old = {c.get("type"): c for c in previous or ()}
    out = []
    for c in sorted(new, key=lambda c: CONDITION_TYPES.index(c.type)):
        prev = old.get(c.type)
        since = prev.get("lastTransitionTime") if prev and prev.get("status") == c.status else None
        out.append({"type": c.type, "status": c.status, "reason": c.reason, "message": c.message,
                    "lastTransitionTime": since or now})
    return out


def serving_status(previous: Mapping[str, Any], pools: Mapping[str, Mapping[str, Any]],
                   replicas: Mapping[str, Replicas | None], router: Replicas | None, now: str) -> dict[str, Any]:
    """The status fields that change, for an applied spec. `replicas` has every pool of the spec (None: no
    Deployment yet); `pools` the entries to write (desiredReplicas, readyReplicas, maybe lastScaling). Pools
    gone from the spec are removed (null in a merge patch)."""
    out: dict[str, Any] = {}
    old_pools = previous.get("pools") or {}
    pool_patch: dict[str, Any] = {name: None for name in old_pools if name not in replicas}
    pool_patch.update({name: entry for name, entry in pools.items() if not contains(old_pools.get(name), entry)})
    if pool_patch:
        out["pools"] = pool_patch
    total = sum(r.ready for r in replicas.values() if r is not None)
    if previous.get("readyReplicas") != total:
        out["readyReplicas"] = total
    conditions = merge_conditions(previous.get("conditions"), serving_conditions(replicas, router), now)
    if conditions != list(previous.get("conditions") or []):
        out["conditions"] = conditions
    return out


def utcnow() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


# ---- Kubernetes API ----------------------------------------------------------------------------------

_PLURALS = {"ConfigMap": "configmaps", "Service": "services", "ServiceAccount": "serviceaccounts",
            "PersistentVolumeClaim": "persistentvolumeclaims", "Pod": "pods", "Deployment": "deployments",
            "Role": "roles", "RoleBinding": "rolebindings"}


def collection_path(api_version: str, kind: str, namespace: str) -> str:
    base = "/api/v1" if api_version == "v1" else f"/apis/{api_version}"
    return f"{base}/namespaces/{namespace}/{_PLURALS[kind]}"


def selector(labels: Mapping[str, str]) -> str:
    return ",".join(f"{k}={v}" for k, v in labels.items())


class Kube:
    """JSON in, JSON out over a kubernetes_asyncio ApiClient."""

    def __init__(self, api: client.ApiClient) -> None:
        self.api = api
        self.closing = False
        self._users = 0
        self._idle = asyncio.Event()
        self._idle.set()

    @contextlib.asynccontextmanager
    async def in_use(self) -> AsyncIterator[None]:
        """Held by a handler while it talks to the API. On exit kopf may still be running a timer tick (or
        start one) after the cleanup handler began: `close` waits for the ticks that hold this."""
        self._users += 1
        self._idle.clear()
        try:
            yield
        finally:
            self._users -= 1
            if not self._users:
                self._idle.set()

    @classmethod
    async def connect(cls) -> Kube:
        cfg = client.Configuration()
        try:
            config.load_incluster_config(client_configuration=cfg)
        except config.ConfigException:
            # $KUBECONFIG is read here, not at import time as the library's default does
            await config.load_kube_config(config_file=os.environ.get("KUBECONFIG") or None, client_configuration=cfg)
        return cls(client.ApiClient(cfg))

    async def close(self, grace_s: float = 10.0) -> None:
        self.closing = True
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._idle.wait(), grace_s)
        await self.api.close()

    async def request(self, method: str, path: str, *, query: Mapping[str, str] | None = None, body: Any = None,
                      content_type: str = "application/json") -> Any:
        return await self.api.call_api(
            path, method, query_params=list((query or {}).items()),
            header_params={"Accept": "application/json", "Content-Type": content_type}, body=body,
            auth_settings=["BearerToken"], response_types_map={200: "object", 201: "object"},
            _return_http_data_only=True)

    async def get(self, path: str) -> dict[str, Any] | None:
        try:
            return await self.request("GET", path)
        except ApiException as e:
            if e.status == 404:
                return None
            raise

    async def list(self, path: str, labels: Mapping[str, str]) -> list[dict[str, Any]]:
        return (await self.request("GET", path, query={"labelSelector": selector(labels)})).get("items") or []

    async def create(self, path: str, obj: Mapping[str, Any]) -> dict[str, Any]:
        return await self.request("POST", path, body=obj)

    async def merge_patch(self, path: str, body: Mapping[str, Any]) -> dict[str, Any]:
        return await self.request("PATCH", path, body=body, content_type="application/merge-patch+json")


async def apply(kube: Kube, obj: Mapping[str, Any]) -> dict[str, Any]:
    """Create `obj`, or patch the existing one to match it; returns the object as the server has it."""
    meta = obj["metadata"]
    collection = collection_path(obj["apiVersion"], obj["kind"], meta["namespace"])
    path = f"{collection}/{meta['name']}"
    existing = await kube.get(path)
    if existing is None:
        try:
            return await kube.create(collection, obj)
        except ApiException as e:
            if e.status != 409:  # 409: created meanwhile (a concurrent reconcile): patch it instead
                raise
            existing = await kube.get(path) or {}
    body = patch_for(obj, existing)
    return existing if body is None else await kube.merge_patch(path, body)


async def scrape_pod_metrics(ip: str) -> PodMetrics | None:
    """One engine's load from its /metrics; None when it does not answer (tests replace this function)."""
    host = f"[{ip}]" if ":" in ip else ip
    try:
        async with httpx.AsyncClient(timeout=SCRAPE_TIMEOUT_S) as http:
            response = await http.get(f"http://{host}:{ENGINE_PORT}/metrics")
        return parse_pod_metrics(response.text) if response.status_code == 200 else None
    except (httpx.HTTPError, ValueError):  # unreachable, or not our metrics: this pod does not report
        return None


# ---- handlers ----------------------------------------------------------------------------------------


def _lock(memo: kopf.Memo) -> asyncio.Lock:
    # One per object, shared by its reconcile and its timer: a reconcile reads the engine Deployments'
    # replicas and writes them back, and a scale in between would be undone.
    return memo.setdefault("lock", asyncio.Lock())


def _message(e: ApiException) -> str:
    return f"{e.status} {e.reason}: {(e.body or '')[:500]}"


@kopf.on.startup()
async def startup(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
    settings.persistence.finalizer = FINALIZER
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=GROUP)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(prefix=GROUP,
                                                                            key="last-handled-configuration")
    # kopf posts an Event for every INFO log line of a handler ("Handler ... succeeded"); with a timer per
    # object that is noise. Our own events go through kopf.event, which the level does not filter.
    settings.posting.level = logging.WARNING
    settings.posting.reporting_component = "pagefleet-operator"  # the "From" column of `kubectl describe`
    # On exit (and deletion) kopf gives a running timer only a few event-loop cycles, then leaves it orphaned,
    # still using the API client that cleanup closes. A tick is a few API calls and scrapes: let it finish.
    settings.background.instant_exit_timeout = SCRAPE_TIMEOUT_S + 1
    # per-object memos are shallow copies of this one: every handler shares the client
    memo.kube = await Kube.connect()


@kopf.on.cleanup()
async def cleanup(memo: kopf.Memo, **_: Any) -> None:
    kube = memo.get("kube")
    if kube is not None:
        await kube.close()


@kopf.on.resume(GROUP, VERSION, PLURAL)
@kopf.on.create(GROUP, VERSION, PLURAL)
@kopf.on.update(GROUP, VERSION, PLURAL)
async def reconcile(body: kopf.Body, name: str, namespace: str, meta: kopf.Meta, status: kopf.Status,
                    patch: kopf.Patch, memo: kopf.Memo, **_: Any) -> None:
    now = utcnow()
    observed = {"observedGeneration": meta.get("generation"), "url": f"http://{name}.{namespace}.svc.cluster.local"}
    spec, problem = check_spec(body.get("spec") or {})
    if spec is None:
        assert problem is not None
        memo["problem"] = problem
        patch.status.update(observed)
        _report(body, status, patch, problem, now)
        return  # no exception: kopf would retry a spec that can only be fixed by editing it
    kube: Kube = memo.kube
    names = object_names(name, spec)
    deployments = collection_path("apps/v1", "Deployment", namespace)
    try:
        async with _lock(memo), kube.in_use():
            current = {}
            for pool in spec.pools:
                dep = await kube.get(f"{deployments}/{names[f'pool:{pool.name}']}")
                current[pool.name] = None if dep is None else dep.get("spec", {}).get("replicas")
            objs = render_objects(name, namespace, spec, spec.model.served_name or name,
                                  carried_replicas(spec, current))
            applied = {}
            for obj in objs:
                # not kopf.adopt: it also copies the owner's labels to the children, and a GitOps tool's
                # tracking label there would make it claim (and prune) objects that are not in Git
                kopf.append_owner_reference(obj, owner=body)
                applied[(obj["kind"], obj["metadata"]["name"])] = await apply(kube, obj)
            memo["problem"] = None
    except ApiException as e:
        if e.status in (400, 422):  # the server rejects what we render (e.g. bad resources): waiting won't help
            memo["problem"] = Problem("ApplyFailed", _message(e))
            patch.status.update(observed)
            _report(body, status, patch, memo["problem"], now)
            return
        # conflicts, throttling, an API server away: worth a retry (and this generation is not observed yet)
        raise kopf.TemporaryError(f"applying the children failed: {_message(e)}", delay=10) from e
    replicas = {p.name: deployment_replicas(applied.get(("Deployment", names[f"pool:{p.name}"])))
                for p in spec.pools}
    pools = {p: {"desiredReplicas": r.desired, "readyReplicas": r.ready} for p, r in replicas.items() if r}
    router = deployment_replicas(applied.get(("Deployment", names["router"])))
    patch.status.update({**observed, **serving_status(status, pools, replicas, router, now)})


def _report(body: kopf.Body, status: Mapping[str, Any], patch: kopf.Patch, problem: Problem, now: str) -> None:
    # the module logger, not kopf's: kopf would also post the warning as an Event (reason "Logging")
    meta = body.get("metadata", {})
    log.warning("%s/%s: %s: %s", meta.get("namespace"), meta.get("name"), problem.reason, problem.message)
    patch.status["conditions"] = merge_conditions(status.get("conditions"),
                                                  problem_conditions(problem, status.get("conditions")), now)
    kopf.event(body, type="Warning", reason=problem.reason, message=problem.message)


@kopf.timer(GROUP, VERSION, PLURAL, interval=AUTOSCALE_INTERVAL, backoff=AUTOSCALE_INTERVAL)
async def autoscale(body: kopf.Body, name: str, namespace: str, status: kopf.Status, patch: kopf.Patch,
                    memo: kopf.Memo, logger: kopf.Logger, stopped: kopf.DaemonStopped, **_: Any) -> None:
    spec, problem = check_spec(body.get("spec") or {})
    kube: Kube = memo.kube
    # "problem" is the verdict of the last reconcile in this process (None: applied). Until one ran, the
    # children may not exist or not match the spec yet: nothing to scale. With an invalid spec, nothing either.
    if spec is None or "problem" not in memo or kube.closing:
        return
    names = object_names(name, spec)
    deployments = collection_path("apps/v1", "Deployment", namespace)
    pods_path = collection_path("v1", "Pod", namespace)
    histories: dict[str, tuple] = memo.setdefault("autoscale_history", {})  # per object: not in the global memo
    pools: dict[str, dict[str, Any]] = {}
    replicas: dict[str, Replicas | None] = {}
    async with _lock(memo), kube.in_use():
        for pool in spec.pools:
            if stopped:  # the operator exits or the object goes: no new scaling decisions
                return
            path = f"{deployments}/{names[f'pool:{pool.name}']}"
            dep = await kube.get(path)
            current = deployment_replicas(dep)
            if dep is None or current is None:
                replicas[pool.name] = None  # not created yet, or deleted by hand: the next reconcile makes it
                continue
            ips = ready_pod_ips(await kube.list(pods_path, pod_selector(name, "engine", pool.name)))
            samples = await asyncio.gather(*(scrape_pod_metrics(ip) for ip in ips))
            measured = [m for m in samples if m is not None]
            decision = decide(pool.autoscaling.params(), current.desired, measured or None,
                              histories.get(pool.name, ()), time.monotonic())
            histories[pool.name] = decision.history
            entry: dict[str, Any] = {"desiredReplicas": decision.replicas, "readyReplicas": current.ready}
            if decision.replicas != current.desired:
                await kube.merge_patch(path, {"spec": {"replicas": decision.replicas}})
                entry["lastScaling"] = {"time": utcnow(), "from": current.desired, "to": decision.replicas,
                                        "reason": decision.reason, "metrics": decision.metrics}
                logger.info("pool %s: %s", pool.name, decision.reason)
                kopf.event(body, type="Normal", reason="Scaled", message=f"pool {pool.name}: {decision.reason}")
            pools[pool.name] = entry
            replicas[pool.name] = Replicas(decision.replicas, current.ready)
        router = deployment_replicas(await kube.get(f"{deployments}/{names['router']}"))
    update = serving_status(status, pools, replicas, router, utcnow())
    if memo["problem"] is not None:
        # The conditions say why the spec is not applied; only a reconcile clears that. The memo, not the
        # timer's `status`: that is a snapshot from before the lock, and a reconcile's status patch lands only
        # after it returns.
        update.pop("conditions", None)
    patch.status.update(update)


def run_operator(namespace: str | None, liveness_port: int = 8081) -> int:
    """`pagefleet operator`: run kopf until SIGINT/SIGTERM. One replica (standalone: no peering objects);
    namespace-scoped when `namespace` is given, cluster-wide otherwise."""
    kopf.configure(log_prefix=True)  # "[namespace/name]" in front of each object's log lines
    kopf.run(standalone=True, clusterwide=namespace is None, namespaces=[namespace] if namespace else (),
             liveness_endpoint=f"http://0.0.0.0:{liveness_port}/healthz")
    return 0
