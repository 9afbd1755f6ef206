"""The operator's kopf handlers: pure helpers, then the real kopf wiring against kmock.

kopf runs in a thread with its own event loop (as kopf's own KopfRunner does): on shutdown it cancels every
task its loop holds, and kmock's server tasks must not be among them. kmock (tests/kmock_k8s.py) serves the
API on a local port; a kubeconfig file points kopf's login and the handlers' client at it. The test's loop
reads the emulator's objects directly and writes through HTTP, so the operator sees every change as an
event, as from a real API server. kopf runs cluster-wide here (see kmock_k8s.py: kmock cannot list
namespaces, which namespaced kopf does).
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import json
import os
import threading
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import kmock
import kopf
import pytest
import yaml
from kmock_k8s import kubeconfig as write_kubeconfig
from kmock_k8s import label_selector_matches, serving

# The autoscaler's interval here. PAGEFLEET_AUTOSCALE_INTERVAL is read when handlers is imported, just below.
TIMER_S = 0.5
_saved_env = os.environ.get("PAGEFLEET_AUTOSCALE_INTERVAL")
os.environ["PAGEFLEET_AUTOSCALE_INTERVAL"] = str(TIMER_S)
from pagefleet.operator import handlers  # noqa: E402
from pagefleet.operator.autoscale import PodMetrics  # noqa: E402
from pagefleet.operator.crd import crd_manifest  # noqa: E402
from pagefleet.operator.handlers import (  # noqa: E402
    Problem,
    Replicas,
    carried_replicas,
    check_spec,
    contains,
    merge_conditions,
    patch_for,
    problem_conditions,
    ready_pod_ips,
    serving_conditions,
    serving_status,
)
from pagefleet.operator.render import labels, render_objects  # noqa: E402
from pagefleet.operator.spec import InferenceServiceSpec  # noqa: E402

if _saved_env is None:
    del os.environ["PAGEFLEET_AUTOSCALE_INTERVAL"]
else:
    os.environ["PAGEFLEET_AUTOSCALE_INTERVAL"] = _saved_env

ROOT = Path(__file__).resolve().parent.parent
NS = "serving"
ISVC = "pagefleet.dev/v1alpha1/inferenceservices"
RESOURCES = {"ConfigMap": "v1/configmaps", "PersistentVolumeClaim": "v1/persistentvolumeclaims",
             "Deployment": "apps/v1/deployments", "Service": "v1/services", "ServiceAccount": "v1/serviceaccounts",
             "Role": "rbac.authorization.k8s.io/v1/roles", "RoleBinding": "rbac.authorization.k8s.io/v1/rolebindings",
             "Pod": "v1/pods", "Event": "v1/events", "InferenceService": ISVC}


def quickstart() -> dict[str, Any]:
    doc = yaml.safe_load((ROOT / "examples" / "quickstart.yaml").read_text())
    doc["metadata"]["namespace"] = NS
    return doc


def isvc(name: str, spec: dict[str, Any]) -> dict[str, Any]:
    return {"apiVersion": "pagefleet.dev/v1alpha1", "kind": "InferenceService",
            "metadata": {"name": name, "namespace": NS}, "spec": spec}


# ---- pure helpers ------------------------------------------------------------------------------------


@pytest.mark.parametrize(("spec", "reason", "message"), [
    ({"model": {"uri": "hf://a/b"}, "engine": {"quantization": "int4"}}, "Unsupported", "engine.quantization: int4"),
    ({"model": {"uri": "hf://a/b"}, "pools": [{"name": "a"}, {"name": "b"}]}, "Unsupported",
     "the router serves one pool per InferenceService for now"),
    ({"model": {"uri": "hf://a/b"}, "engine": {"blockSize": 7}}, "InvalidSpec", "spec.engine.blockSize: "),
    ({"model": {"uri": "hf://a/b"}, "pools": [{"name": "main", "autoscaling": {"minReplicas": 3}}]},
     "InvalidSpec", "spec.pools[0].autoscaling: Value error, minReplicas (3) must be <= maxReplicas (1)"),
    ({"model": {"uri": "hf://a/b"}, "engine": {"bogus": 1}}, "InvalidSpec", "spec.engine.bogus: Extra inputs"),
    ({"model": {"uri": "/models/tiny"}}, "InvalidSpec", "set model.pvc"),
])
def test_check_spec_reports_why(spec, reason, message):
    parsed, problem = check_spec(spec)
    assert parsed is None
    assert problem.reason == reason
    assert message in problem.message


def test_check_spec_accepts_the_quickstart():
    parsed, problem = check_spec(quickstart()["spec"])
    assert problem is None and parsed.pools[0].autoscaling.max_replicas == 2


def test_carried_replicas_keeps_the_autoscalers_count_within_bounds():
    spec = InferenceServiceSpec.model_validate({"model": {"uri": "hf://a/b"}, "pools": [
        {"name": "main", "autoscaling": {"minReplicas": 2, "maxReplicas": 5}}]})
    assert carried_replicas(spec, {}) == {"main": 2}  # no Deployment yet: minReplicas
    assert carried_replicas(spec, {"main": None}) == {"main": 2}
    assert carried_replicas(spec, {"main": 4}) == {"main": 4}  # what the autoscaler set
    assert carried_replicas(spec, {"main": 9}) == {"main": 5}  # maxReplicas lowered
    assert carried_replicas(spec, {"main": 1}) == {"main": 2}  # minReplicas raised


def test_patch_for_is_none_when_the_server_only_added_defaults():
    desired = {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "s", "labels": {"a": "1"}},
               "spec": {"ports": [{"port": 80}], "selector": {"a": "1"}}}
    existing = copy.deepcopy(desired)
    existing["metadata"].update(uid="u", resourceVersion="7", annotations={"x": "y"})
    existing["spec"]["ports"][0]["protocol"] = "TCP"
    existing["spec"]["clusterIP"] = "10.0.0.1"
    assert patch_for(desired, existing) is None
    changed = copy.deepcopy(desired)
    changed["spec"]["ports"] = [{"port": 81}]
    assert patch_for(changed, existing) == {"metadata": {"labels": {"a": "1"}},
                                            "spec": {"ports": [{"port": 81}], "selector": {"a": "1"}}}


def test_patch_for_keeps_other_owners_and_leaves_a_claims_spec_alone():
    ours = {"uid": "u1", "kind": "InferenceService", "name": "x"}
    other = {"uid": "u0", "kind": "Something", "name": "y"}
    desired = {"apiVersion": "v1", "kind": "PersistentVolumeClaim",
               "metadata": {"name": "c", "labels": {"a": "1"}, "ownerReferences": [ours]},
               "spec": {"resources": {"requests": {"storage": "50Gi"}}}}
    existing = {"metadata": {"name": "c", "ownerReferences": [other]},
                "spec": {"resources": {"requests": {"storage": "20Gi"}}, "volumeName": "pv-1"}}
    assert patch_for(desired, existing) == {"metadata": {"labels": {"a": "1"}, "ownerReferences": [other, ours]}}


def test_contains_compares_lists_item_by_item():
    assert contains({"a": [{"x": 1, "y": 2}]}, {"a": [{"x": 1}]})
    assert not contains({"a": [{"x": 1}, {"x": 2}]}, {"a": [{"x": 1}]})
    assert not contains({"a": [{"x": 1}]}, {"a": [{"x": 2}]})
    assert not contains(None, {"a": 1})


def test_ready_pod_ips_takes_ready_running_pods_only():
    def pod(ip, ready="True", deleting=False):
        meta = {"deletionTimestamp": "2024-01-01T00:00:00Z"} if deleting else {}
        return {"metadata": meta, "status": {"podIP": ip, "conditions": [{"type": "Ready", "status": ready}]}}

    pods = [pod("10.0.0.1"), pod("10.0.0.2", "False"), pod("10.0.0.3", deleting=True), pod(None),
            {"metadata": {}, "status": {}}]
    assert ready_pod_ips(pods) == ["10.0.0.1"]


def test_serving_conditions():
    by_type = {c.type: c for c in serving_conditions({"main": Replicas(2, 1)}, Replicas(1, 1))}
    assert (by_type["Ready"].status, by_type["Ready"].reason) == ("True", "Serving")
    assert by_type["EnginesReady"].status == "True"
    assert (by_type["Progressing"].status, by_type["Progressing"].message) == ("True", "main: 1/2 ready")
    assert by_type["Degraded"].status == "False"
    by_type = {c.type: c for c in serving_conditions({"main": None}, Replicas(1, 1))}
    assert (by_type["Ready"].status, by_type["Ready"].reason) == ("False", "EnginesNotReady")
    assert (by_type["EnginesReady"].reason, by_type["RouterReady"].status) == ("NoReadyReplicas", "True")
    by_type = {c.type: c for c in serving_conditions({"main": Replicas(1, 1)}, None)}
    assert (by_type["Ready"].reason, by_type["RouterReady"].status) == ("RouterNotReady", "False")


def test_merge_conditions_moves_transition_time_only_on_status_change():
    first = merge_conditions(None, serving_conditions({"main": Replicas(1, 0)}, Replicas(1, 0)), "T1")
    assert [c["type"] for c in first] == ["Ready", "EnginesReady", "RouterReady", "Progressing", "Degraded"]
    second = merge_conditions(first, serving_conditions({"main": Replicas(1, 1)}, Replicas(1, 0)), "T2")
    times = {c["type"]: c["lastTransitionTime"] for c in second}
    assert times == {"Ready": "T1", "EnginesReady": "T2", "RouterReady": "T1", "Progressing": "T1",
                     "Degraded": "T1"}


def test_problem_conditions_keep_the_last_readiness():
    before = merge_conditions(None, serving_conditions({"main": Replicas(1, 1)}, Replicas(1, 1)), "T1")
    after = merge_conditions(before, problem_conditions(Problem("Unsupported", "no"), before), "T2")
    by_type = {c["type"]: c for c in after}
    assert (by_type["Ready"]["status"], by_type["Ready"]["reason"], by_type["Ready"]["message"]) == (
        "False", "Unsupported", "no")
    assert (by_type["Degraded"]["status"], by_type["Degraded"]["lastTransitionTime"]) == ("True", "T2")
    assert by_type["EnginesReady"] == {**before[1]}  # the old engines still run
    fresh = {c.type: c.status for c in problem_conditions(Problem("InvalidSpec", "bad"), None)}
    assert fresh["EnginesReady"] == fresh["RouterReady"] == "Unknown"


def test_serving_status_patches_only_what_changed():
    replicas = {"main": Replicas(2, 1)}
    status = serving_status({}, {"main": {"desiredReplicas": 2, "readyReplicas": 1}}, replicas, Replicas(1, 1), "T")
    assert status["pools"] == {"main": {"desiredReplicas": 2, "readyReplicas": 1}} and status["readyReplicas"] == 1
    previous = {**status, "pools": {"main": {**status["pools"]["main"], "lastScaling": {"to": 2}},
                                    "old": {"desiredReplicas": 1}}}
    again = serving_status(previous, {"main": {"desiredReplicas": 2, "readyReplicas": 1}}, replicas, Replicas(1, 1),
                           "T2")
    assert again == {"pools": {"old": None}}  # a pool gone from the spec; nothing else changed
    # a pool of the spec without a Deployment (deleted by hand) keeps its entry
    gone = serving_status(previous, {}, {"main": None, "old": None}, Replicas(1, 1), "T3")
    assert "pools" not in gone and gone["readyReplicas"] == 0


def test_kmock_wrapper_behaves_like_an_api_server_where_kopf_needs_it():
    path = "/api/v1/namespaces/ns/configmaps"

    async def main() -> None:
        async with serving() as (k8s, _):
            async def send(method: str, url: str, body: Any = None, content_type: str = "application/json"):
                async with k8s.request(method, url, json=body, headers={"Content-Type": content_type}) as r:
                    return r.status, await r.json()

            status, cm = await send("POST", path, {"metadata": {"generateName": "cm-", "labels": {"a": "1"}},
                                                   "data": {"k": "v"}})
            meta = cm["metadata"]
            assert status == 201 and meta["name"].startswith("cm-") and meta["namespace"] == "ns"
            assert meta["uid"] and meta["creationTimestamp"] and (meta["generation"], meta["resourceVersion"]) == (
                1, "1")
            name = meta["name"]
            _, cm = await send("PATCH", f"{path}/{name}", {"spec": {"x": 1}}, "application/merge-patch+json")
            assert (cm["metadata"]["generation"], cm["metadata"]["resourceVersion"]) == (2, "2")
            _, cm = await send("PATCH", f"{path}/{name}/status", {"status": {"y": 1}}, "application/merge-patch+json")
            assert (cm["metadata"]["generation"], cm["metadata"]["resourceVersion"]) == (2, "3")
            status, _ = await send("PATCH", f"{path}/{name}", [
                {"op": "test", "path": "/metadata/resourceVersion", "value": "2"},
                {"op": "add", "path": "/metadata/finalizers", "value": ["f"]}], "application/json-patch+json")
            assert status == 422  # stale resourceVersion: kopf retries on the next event
            status, cm = await send("PATCH", f"{path}/{name}", [
                {"op": "test", "path": "/metadata/resourceVersion", "value": "3"},
                {"op": "add", "path": "/metadata/finalizers", "value": ["f"]}], "application/json-patch+json")
            assert status == 200 and cm["metadata"]["resourceVersion"] == "4"
            await send("POST", path, {"metadata": {"name": "other", "labels": {"a": "2"}}})
            _, listing = await send("GET", f"{path}?labelSelector=a%3D1")
            assert [i["metadata"]["name"] for i in listing["items"]] == [name]
            assert listing["metadata"]["resourceVersion"] == "5"

            # A watch from revision 4 replays only what changed after it, then follows new writes.
            async with k8s.get(f"{path}?watch=true&resourceVersion=4") as stream:
                await send("PATCH", f"{path}/{name}", {"data": {"k": "w"}}, "application/merge-patch+json")
                seen = []
                async for line in stream.content:
                    if line.strip():
                        event = json.loads(line)
                        seen.append((event["type"], event["object"]["metadata"]["name"],
                                     event["object"]["metadata"]["resourceVersion"]))
                    if len(seen) == 2:
                        break
            assert seen == [("ADDED", "other", "5"), ("MODIFIED", name, "6")]

    asyncio.run(asyncio.wait_for(main(), 10))


def test_label_selector_matches():
    assert label_selector_matches({"a": "1", "b": "2"}, "a=1,b==2")
    assert label_selector_matches({"a": "1"}, "a,!b,c!=3")
    assert not label_selector_matches({"a": "1"}, "a=2")
    assert not label_selector_matches({"a": "1"}, "!a")


def test_run_operator_passes_scope_and_liveness(monkeypatch):
    calls: list[dict[str, Any]] = []
    monkeypatch.setattr(kopf, "configure", lambda **kw: None)
    monkeypatch.setattr(kopf, "run", lambda **kw: calls.append(kw))
    assert handlers.run_operator("team-a", 9090) == 0
    assert handlers.run_operator(None) == 0
    assert calls[0]["namespaces"] == ["team-a"] and calls[0]["clusterwide"] is False
    assert calls[0]["liveness_endpoint"] == "http://0.0.0.0:9090/healthz"
    assert calls[1]["clusterwide"] is True and not calls[1]["namespaces"]
    assert calls[1]["liveness_endpoint"] == "http://0.0.0.0:8081/healthz"
    assert all(c["standalone"] for c in calls)


# ---- kopf against kmock ------------------------------------------------------------------------------


async def until(predicate: Callable[[], Any], what: str, timeout: float = 15.0) -> Any:
    deadline = asyncio.get_running_loop().time() + timeout
    while not (result := predicate()):
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        await asyncio.sleep(0.02)
    return result


class Cluster:
    """What the tests need from the emulator: read objects directly, write through HTTP."""

    def __init__(self, k8s: Any) -> None:
        self.k8s = k8s

    def get(self, kind: str, name: str) -> dict[str, Any] | None:
        key = (kmock.resource(RESOURCES[kind]), NS, name)
        if key not in self.k8s.objects or self.k8s.objects[key].deleted:
            return None
        return self.k8s.objects[key].raw

    def all(self, kind: str) -> list[dict[str, Any]]:
        return [obj.raw for (res, ns, _), obj in list(self.k8s.objects.items())
                if res == RESOURCES[kind] and ns == NS and not obj.deleted]

    def status(self, name: str) -> dict[str, Any]:
        return (self.get("InferenceService", name) or {}).get("status") or {}

    def condition(self, name: str, kind: str) -> dict[str, Any]:
        return next((c for c in self.status(name).get("conditions", []) if c["type"] == kind), {})

    def owned_by(self, uid: str) -> list[dict[str, Any]]:
        return [o for kind in RESOURCES if kind not in ("Event", "InferenceService", "Pod") for o in self.all(kind)
                if any(r.get("uid") == uid for r in o["metadata"].get("ownerReferences") or [])]

    async def send(self, method: str, path: str, body: Any, content_type: str = "application/json") -> dict:
        async with self.k8s.request(method, path, json=body, headers={"Content-Type": content_type}) as response:
            assert response.status in (200, 201), await response.text()
            return await response.json()

    async def create(self, kind: str, obj: dict[str, Any]) -> dict[str, Any]:
        return await self.send("POST", f"{_api(RESOURCES[kind])}/namespaces/{NS}/{RESOURCES[kind].rsplit('/', 1)[1]}",
                               obj)

    async def patch(self, kind: str, name: str, body: dict[str, Any], subresource: str = "") -> dict[str, Any]:
        plural = RESOURCES[kind].rsplit("/", 1)[1]
        return await self.send("PATCH", f"{_api(RESOURCES[kind])}/namespaces/{NS}/{plural}/{name}{subresource}", body,
                               "application/merge-patch+json")

    async def delete(self, kind: str, name: str) -> None:
        plural = RESOURCES[kind].rsplit("/", 1)[1]
        async with self.k8s.delete(f"{_api(RESOURCES[kind])}/namespaces/{NS}/{plural}/{name}") as response:
            assert response.status == 200, await response.text()


def _api(resource: str) -> str:
    group_version = resource.rsplit("/", 1)[0]
    return "/api/v1" if group_version == "v1" else f"/apis/{group_version}"


def _fast_timer() -> None:
    """The timer's interval comes from PAGEFLEET_AUTOSCALE_INTERVAL when handlers is imported (set above). If
    something imported it earlier with another value, shorten the registered timer so that the test does not
    wait for it."""
    for handler in kopf.get_default_registry()._spawning.get_all_handlers():
        if handler.id == "autoscale" and getattr(handler, "interval", TIMER_S) != TIMER_S:
            object.__setattr__(handler, "interval", TIMER_S)  # a frozen dataclass; only in this test process


@contextlib.asynccontextmanager
async def fake_cluster(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[Cluster]:
    """kmock with the CRD, and the kubeconfig that kopf's login and the handlers' client read."""
    from kubernetes_asyncio.config import kube_config

    async with serving([crd_manifest()]) as (k8s, url):
        config = write_kubeconfig(tmp_path / "kubeconfig", url, NS)
        monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)  # never the in-cluster login
        monkeypatch.setenv("KUBECONFIG", str(config))  # the handlers' client
        monkeypatch.setattr(kube_config, "KUBE_CONFIG_DEFAULT_LOCATION", str(config))  # kopf's login
        yield Cluster(k8s)


@contextlib.asynccontextmanager
async def operator_running() -> AsyncIterator[None]:
    """kopf with the handlers (default registry) in its own thread and loop, until the block ends."""
    _fast_timer()
    stop, ready = threading.Event(), threading.Event()
    errors: list[BaseException] = []

    def run() -> None:
        try:
            asyncio.run(kopf.operator(clusterwide=True, standalone=True, stop_flag=stop, ready_flag=ready))
        except BaseException as e:  # noqa: BLE001 - reported by the test
            errors.append(e)

    thread = threading.Thread(target=run, name="kopf", daemon=True)
    thread.start()
    try:
        await until(lambda: ready.is_set() or not thread.is_alive(), "kopf to start", 10)
        assert not errors, errors
        yield
    finally:
        stop.set()
        await asyncio.to_thread(thread.join, 15)
        assert not thread.is_alive(), "kopf did not stop"
    assert not errors, errors


def run_scenario(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fn: Callable[..., Any], *args: Any) -> None:
    """`fn(cluster, *args)` against a running operator, bounded in time."""
    async def main() -> None:
        async with fake_cluster(tmp_path, monkeypatch) as cluster, operator_running():
            await fn(cluster, *args)

    asyncio.run(asyncio.wait_for(main(), 45))


LOCAL_MODEL = isvc("tiny", {"model": {"uri": "/models/tiny-llama", "pvc": "models"},
                            "pools": [{"name": "main", "autoscaling": {"minReplicas": 2, "maxReplicas": 3}}]})


@pytest.mark.parametrize("doc", [quickstart(), LOCAL_MODEL], ids=["quickstart", "local-path-pvc"])
def test_create_renders_owned_children_and_status(tmp_path, monkeypatch, doc):
    """An InferenceService gets every rendered child, owned by it, and a status; readiness follows the
    Deployments' readyReplicas."""
    run_scenario(tmp_path, monkeypatch, _creates_owned_children, doc)


async def _creates_owned_children(cluster: Cluster, doc: dict[str, Any]) -> None:
    name = doc["metadata"]["name"]
    created = await cluster.create("InferenceService", copy.deepcopy(doc))
    uid = created["metadata"]["uid"]
    spec = InferenceServiceSpec.model_validate(doc["spec"])
    expected = render_objects(name, NS, spec, spec.model.served_name or name)
    await until(lambda: len(cluster.owned_by(uid)) == len(expected), "every child object")
    for want in expected:
        have = cluster.get(want["kind"], want["metadata"]["name"])
        assert have is not None, want["metadata"]["name"]
        assert contains(have, {k: v for k, v in want.items() if k != "metadata"}), want["metadata"]["name"]
        assert have["metadata"]["labels"] == want["metadata"]["labels"]
        assert have["metadata"]["ownerReferences"] == [{
            "apiVersion": "pagefleet.dev/v1alpha1", "kind": "InferenceService", "name": name, "uid": uid,
            "controller": True, "blockOwnerDeletion": True}]
    kinds = sorted(o["kind"] for o in expected)
    engine = cluster.get("Deployment", f"{name}-main")
    assert engine["spec"]["replicas"] == spec.pools[0].autoscaling.min_replicas
    if spec.model.pvc:
        assert "PersistentVolumeClaim" not in kinds  # the user's claim, mounted; no download cache
        volumes = engine["spec"]["template"]["spec"]["volumes"]
        assert {"name": "models", "persistentVolumeClaim": {"claimName": "models", "readOnly": True}} in volumes
    else:
        assert kinds.count("PersistentVolumeClaim") == 1

    await until(lambda: cluster.status(name).get("observedGeneration") == 1, "observedGeneration")
    status = cluster.status(name)
    assert status["url"] == f"http://{name}.{NS}.svc.cluster.local"
    assert [c["type"] for c in status["conditions"]] == ["Ready", "EnginesReady", "RouterReady", "Progressing",
                                                         "Degraded"]
    assert cluster.condition(name, "Ready")["status"] == "False"
    assert cluster.condition(name, "Progressing")["status"] == "True"
    assert cluster.condition(name, "Degraded")["status"] == "False"
    degraded_since = cluster.condition(name, "Degraded")["lastTransitionTime"]
    assert cluster.get("InferenceService", name)["metadata"]["finalizers"] == ["pagefleet.dev/finalizer"]

    # The Deployment controller's part: replicas become ready. The timer refreshes the status from it.
    ready = spec.pools[0].autoscaling.min_replicas
    await cluster.patch("Deployment", f"{name}-main", {"status": {"readyReplicas": ready}}, "/status")
    await cluster.patch("Deployment", f"{name}-router", {"status": {"readyReplicas": 1}}, "/status")
    await until(lambda: cluster.condition(name, "Ready").get("status") == "True", "Ready=True")
    assert cluster.condition(name, "Ready")["reason"] == "Serving"
    assert cluster.condition(name, "Progressing")["status"] == "False"
    assert cluster.condition(name, "Degraded")["lastTransitionTime"] == degraded_since
    assert cluster.status(name)["readyReplicas"] == ready
    assert cluster.status(name)["pools"]["main"] == {"desiredReplicas": ready, "readyReplicas": ready}



AUTOSCALED = isvc("auto", {"model": {"uri": "pagefleet://tiny"}, "pools": [{"name": "main", "autoscaling": {
    "minReplicas": 1, "maxReplicas": 6, "scaleUpStep": 2, "targetWaitingPerReplica": 2}}]})


def _pod(name: str, ip: str, pod_labels: dict[str, str], ready: str = "True") -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": NS, "labels": pod_labels},
            "status": {"phase": "Running", "podIP": ip, "conditions": [{"type": "Ready", "status": ready}]}}


def test_autoscaler_scales_the_deployment_and_spec_updates_keep_its_replicas(tmp_path, monkeypatch):
    """The timer scrapes the pool's ready pods, scales the owned Deployment within the step limit, records the
    decision and an Event, and leaves the user's spec alone; a later spec update patches the pods' args and
    keeps the autoscaler's replica count."""
    scraped: list[str] = []

    async def fake_scrape(ip: str) -> PodMetrics:
        scraped.append(ip)
        # Busy on the first scrape (10 waiting per replica, target 2), then at target for 3 replicas.
        return PodMetrics(waiting=20.0 if len(scraped) == 1 else 6.0, running=4.0, kv_usage=0.1)

    monkeypatch.setattr(handlers, "scrape_pod_metrics", fake_scrape)
    run_scenario(tmp_path, monkeypatch, _autoscales, scraped)


async def _autoscales(cluster: Cluster, scraped: list[str]) -> None:
    name = "auto"
    await cluster.create("InferenceService", copy.deepcopy(AUTOSCALED))
    await until(lambda: cluster.get("Deployment", f"{name}-main"), "the engine Deployment")
    await cluster.create("Pod", _pod("auto-main-a", "10.0.0.1", labels(name, "engine", "main")))
    await cluster.create("Pod", _pod("auto-main-b", "10.0.0.2", labels(name, "engine", "main"), ready="False"))
    await cluster.create("Pod", _pod("other-main-a", "10.0.0.9", labels("other", "engine", "main")))

    await until(lambda: cluster.get("Deployment", f"{name}-main")["spec"]["replicas"] != 1, "a scale-up")
    assert cluster.get("Deployment", f"{name}-main")["spec"]["replicas"] == 3  # 1 + scaleUpStep 2, not 10
    scaling = await until(lambda: cluster.status(name).get("pools", {}).get("main", {}).get("lastScaling"),
                          "the decision in status")
    assert (scaling["from"], scaling["to"]) == (1, 3)
    assert scaling["reason"].startswith("scale up 1 -> 3: waiting 20.0/replica > target 2.0")
    assert scaling["metrics"]["waiting_per_replica"] == 20.0
    assert cluster.status(name)["pools"]["main"]["desiredReplicas"] == 3
    event = await until(lambda: next((e for e in cluster.all("Event") if e["reason"] == "Scaled"), None),
                        "the Scaled event")
    assert event["type"] == "Normal" and event["message"].startswith("pool main: scale up 1 -> 3")
    assert event["involvedObject"]["name"] == name and event["involvedObject"]["kind"] == "InferenceService"
    isvc_now = cluster.get("InferenceService", name)
    assert isvc_now["spec"] == AUTOSCALED["spec"] and isvc_now["metadata"]["generation"] == 1  # GitOps: untouched

    # A few more ticks at target: the count holds, and only the ready pod of this pool was ever scraped.
    await until(lambda: len(scraped) >= 3, "more autoscaler ticks")
    assert cluster.get("Deployment", f"{name}-main")["spec"]["replicas"] == 3
    assert set(scraped) == {"10.0.0.1"}

    await cluster.patch("InferenceService", name, {"spec": {"engine": {"kvCacheMemory": "3GiB"},
                                                            "router": {"policy": "least-load"}}})

    def args(deployment: str) -> list[str]:
        return cluster.get("Deployment", deployment)["spec"]["template"]["spec"]["containers"][0]["args"]

    await until(lambda: "3GiB" in args(f"{name}-main"), "the engine args to follow the spec")
    await until(lambda: "least-load" in args(f"{name}-router"), "the router args to follow the spec")
    assert args(f"{name}-main")[args(f"{name}-main").index("--kv-cache-memory") + 1] == "3GiB"
    assert cluster.get("Deployment", f"{name}-main")["spec"]["replicas"] == 3  # not reset to minReplicas
    await until(lambda: cluster.status(name).get("observedGeneration") == 2, "observedGeneration 2")


BAD_SPECS = {
    "int4": ({"model": {"uri": "pagefleet://tiny"}, "engine": {"quantization": "int4"}}, "Unsupported",
             "engine.quantization: int4"),
    "block": ({"model": {"uri": "pagefleet://tiny"}, "engine": {"blockSize": 7}}, "InvalidSpec",
              "spec.engine.blockSize"),
    "path": ({"model": {"uri": "/models/tiny"}}, "InvalidSpec", "model.pvc"),
    "pools": ({"model": {"uri": "pagefleet://tiny"}, "pools": [{"name": "a"}, {"name": "b"}]}, "Unsupported",
              "one pool per InferenceService"),
}


def test_bad_specs_get_a_condition_no_children_and_no_retries(tmp_path, monkeypatch):
    """Each bad spec: Ready=False and Degraded=True with the reason, a Warning event, no child objects, and no
    retry loop; the same for a spec the API server rejects. Fixing the spec applies it."""
    run_scenario(tmp_path, monkeypatch, _bad_specs)


async def _bad_specs(cluster: Cluster) -> None:
    # One more: a valid spec whose engine Deployment the API server rejects (as it would bad `resources`).
    cluster.k8s[kmock.action.CREATE, {"metadata": {"name": "rejected-main"}}] << 422 << {
        "apiVersion": "v1", "kind": "Status", "status": "Failure", "code": 422, "reason": "Invalid",
        "message": 'Deployment.apps "rejected-main" is invalid: spec.template.spec.containers[0].resources'}
    cases = {**BAD_SPECS, "rejected": ({"model": {"uri": "pagefleet://tiny"}}, "ApplyFailed", "422")}
    uids = {}
    for name, (spec, _, _) in cases.items():
        uids[name] = (await cluster.create("InferenceService", isvc(name, spec)))["metadata"]["uid"]
    for name, (_, reason, message) in cases.items():
        await until(lambda name=name: cluster.status(name).get("observedGeneration") == 1, f"{name}: reconciled")
        ready = cluster.condition(name, "Ready")
        assert (ready["status"], ready["reason"]) == ("False", reason), ready
        assert message in ready["message"]
        assert (cluster.condition(name, "Degraded")["status"], cluster.condition(name, "Degraded")["reason"]) == (
            "True", reason)
        assert cluster.condition(name, "EnginesReady")["status"] == "Unknown"
        assert cluster.status(name)["observedGeneration"] == 1
        await until(lambda name=name, reason=reason: [
            e for e in cluster.all("Event") if e["involvedObject"]["name"] == name and e["reason"] == reason
            and e["type"] == "Warning"], f"{name}: a Warning event")

    def versions() -> dict[str, str]:
        return {name: cluster.get("InferenceService", name)["metadata"]["resourceVersion"] for name in cases}

    # kmock stores a create even when a reaction answers it 422: the timer finds that Deployment and reports
    # its pool once. Wait for that write before checking that nothing else comes.
    await until(lambda: cluster.status("rejected").get("pools"), "the timer's one report of the stray Deployment")
    before = versions()
    await asyncio.sleep(1.5)  # three timer ticks: nothing may write to these objects again
    assert versions() == before
    # one Warning each (a retry would post another) and kopf's own failure events, if any, none
    assert sorted(e["involvedObject"]["name"] for e in cluster.all("Event")) == sorted(cases)
    assert not [o for name in BAD_SPECS for o in cluster.owned_by(uids[name])]

    await cluster.patch("InferenceService", "int4", {"spec": {"engine": {"quantization": "none"}}})
    await until(lambda: cluster.get("Deployment", "int4-main"), "the fixed spec's engine Deployment")
    await until(lambda: cluster.condition("int4", "Degraded").get("status") == "False", "Degraded=False")
    assert cluster.condition("int4", "Ready")["reason"] == "EnginesNotReady"
    assert cluster.status("int4")["observedGeneration"] == 2


def test_delete_releases_the_finalizer(tmp_path, monkeypatch):
    """The timer makes kopf hold a finalizer; deleting the InferenceService releases it and the object goes."""
    run_scenario(tmp_path, monkeypatch, _deletes)


async def _deletes(cluster: Cluster) -> None:
    doc = quickstart()
    name = doc["metadata"]["name"]
    await cluster.create("InferenceService", doc)
    await until(lambda: cluster.get("Deployment", f"{name}-router"), "the children")
    await until(lambda: (cluster.get("InferenceService", name)["metadata"].get("finalizers")), "the finalizer")
    await cluster.delete("InferenceService", name)
    await until(lambda: cluster.get("InferenceService", name) is None, "the object to be gone")



def test_resume_repairs_drift_and_keeps_replicas(tmp_path, monkeypatch):
    """After a restart kopf resumes every InferenceService: what changed while the operator was away is put
    back (a deleted ConfigMap, edited router args), and the engine replicas it finds are kept."""
    async def main() -> None:
        async with fake_cluster(tmp_path, monkeypatch) as cluster:
            doc = quickstart()
            name = doc["metadata"]["name"]
            async with operator_running():
                await cluster.create("InferenceService", doc)
                await until(lambda: cluster.get("Service", name), "the children")
            engine, router = f"{name}-main", f"{name}-router"
            await cluster.patch("Deployment", engine, {"spec": {"replicas": 2}})  # as the autoscaler left it
            await cluster.patch("Deployment", router, {"spec": {"template": {"spec": {"containers": [
                {"name": "router", "args": ["router", "--policy", "round-robin"]}]}}}})
            await cluster.delete("ConfigMap", f"{name}-config")
            async with operator_running():
                await until(lambda: cluster.get("ConfigMap", f"{name}-config"), "the ConfigMap back")
                await until(lambda: "--k8s-service" in cluster.get("Deployment", router)["spec"]["template"][
                    "spec"]["containers"][0]["args"], "the router args back")
                assert cluster.get("Deployment", engine)["spec"]["replicas"] == 2

    asyncio.run(asyncio.wait_for(main(), 45))
