"""Kubernetes objects rendered from InferenceService specs: golden files, the API's own
schemas (kubernetes-validate), and the invariants every pod must keep."""

from __future__ import annotations

import os
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from pagefleet.operator.local import load_file
from pagefleet.operator.render import render_objects
from pagefleet.operator.spec import InferenceService

ROOT = Path(__file__).resolve().parent.parent
GOLDEN = Path(__file__).resolve().parent / "golden"
K8S_VERSION = "1.30"

FULL = {
    "apiVersion": "pagefleet.dev/v1alpha1", "kind": "InferenceService", "metadata": {"name": "coder"},
    "spec": {
        "model": {"uri": "/models/qwen2.5-coder-1.5b-instruct", "pvc": "model-store", "servedName": "coder"},
        "engine": {"image": "registry.example/pagefleet:0.1.0", "kvCacheMemory": "4Gi", "maxModelLen": 8192,
                   "prefixCaching": False, "maxQueue": 64, "threads": 8, "shutdownTimeoutSeconds": 60,
                   "resources": {"requests": {"cpu": "8", "memory": "16Gi"}, "limits": {"memory": "20Gi"}},
                   "nodeSelector": {"pool": "inference"},
                   "tolerations": [{"key": "dedicated", "operator": "Equal", "value": "llm", "effect": "NoSchedule"}],
                   "extraArgs": ["--max-num-seqs", "64"], "env": [{"name": "OMP_NUM_THREADS", "value": "8"}]},
        "pools": [{"name": "main", "autoscaling": {"minReplicas": 2, "maxReplicas": 6}}],
        "router": {"replicas": 2, "policy": "least-load", "resources": {"requests": {"cpu": "500m"}}},
    },
}


def cases() -> dict[str, InferenceService]:
    return {"quickstart": load_file(ROOT / "examples/quickstart.yaml"), "full": InferenceService.model_validate(FULL)}


def rendered(isvc: InferenceService, **kw) -> list[dict]:
    return render_objects(isvc.metadata.name, "serving", isvc.spec, isvc.served_name(), **kw)


@pytest.mark.parametrize("case", ["quickstart", "full"])
def test_golden(case: str) -> None:
    text = yaml.safe_dump_all(rendered(cases()[case]), sort_keys=False, width=120)
    path = GOLDEN / f"{case}.yaml"
    if os.environ.get("UPDATE_GOLDEN"):
        path.write_text(text)
    assert path.read_text() == text, f"rendered objects changed; review and run UPDATE_GOLDEN=1 pytest {__file__}"


@pytest.mark.parametrize("case", ["quickstart", "full"])
def test_every_object_validates_against_the_kubernetes_schema(case: str) -> None:
    for obj in rendered(cases()[case]):
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)


def test_invalid_object_is_caught_by_the_validator() -> None:
    """The check above can fail: a wrong type in a rendered Deployment is reported."""
    dep = next(o for o in rendered(cases()["full"]) if o["kind"] == "Deployment")
    dep["spec"]["replicas"] = "two"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(dep, K8S_VERSION, strict=True)


def test_pod_invariants() -> None:
    isvc = cases()["full"]
    objs = rendered(isvc)
    deps = {o["metadata"]["name"]: o for o in objs if o["kind"] == "Deployment"}
    assert set(deps) == {"coder-main", "coder-router"}
    for dep in deps.values():
        spec = dep["spec"]
        assert spec["strategy"]["rollingUpdate"]["maxUnavailable"] == 0
        pod = spec["template"]["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True
        assert set(spec["selector"]["matchLabels"].items()) <= set(spec["template"]["metadata"]["labels"].items())
        for c in pod["containers"]:
            assert c["securityContext"]["readOnlyRootFilesystem"] is True
            assert c["securityContext"]["allowPrivilegeEscalation"] is False
            assert c["readinessProbe"]["httpGet"]["path"] == "/health"
            assert {"name": "tmp", "mountPath": "/tmp"} in c["volumeMounts"]
    engine_pod = deps["coder-main"]["spec"]["template"]["spec"]
    engine = engine_pod["containers"][0]
    assert deps["coder-main"]["spec"]["replicas"] == 2  # minReplicas at creation
    assert engine["resources"] == FULL["spec"]["engine"]["resources"]  # passed through
    assert engine_pod["nodeSelector"] == {"pool": "inference"} and engine_pod["tolerations"][0]["key"] == "dedicated"
    assert engine_pod["terminationGracePeriodSeconds"] == 70  # drain time + preStop pause + margin
    args = engine["args"]
    assert args[:3] == ["engine", "--model", "/models/qwen2.5-coder-1.5b-instruct"]
    assert "--no-prefix-caching" in args and args[-2:] == ["--max-num-seqs", "64"]
    assert {"name": "models", "mountPath": "/models", "readOnly": True} in engine["volumeMounts"]
    assert engine_pod["automountServiceAccountToken"] is False  # engines never talk to the API
    router_pod = deps["coder-router"]["spec"]["template"]["spec"]
    assert router_pod["serviceAccountName"] == "coder-router"
    assert "--k8s-service" in router_pod["containers"][0]["args"]
    assert router_pod["containers"][0]["args"][router_pod["containers"][0]["args"].index("--k8s-service") + 1] == \
        "main=serving/coder-main:http"
    role = next(o for o in objs if o["kind"] == "Role")
    assert role["rules"] == [{"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"],
                              "verbs": ["list", "watch"]}]  # least privilege
    headless = next(o for o in objs if o["kind"] == "Service" and o["metadata"]["name"] == "coder-main")
    assert headless["spec"]["clusterIP"] == "None"


def test_autoscaled_replicas_survive_a_re_render() -> None:
    objs = rendered(cases()["full"], replicas={"main": 5})
    assert next(o for o in objs if o["metadata"]["name"] == "coder-main")["spec"]["replicas"] == 5


def test_named_models_get_a_shared_cache_claim() -> None:
    objs = rendered(cases()["quickstart"])
    claim = next(o for o in objs if o["kind"] == "PersistentVolumeClaim")
    assert claim["spec"]["accessModes"] == ["ReadWriteMany"]
    engine = next(o for o in objs if o["metadata"]["name"] == "qwen-coder-main")
    c = engine["spec"]["template"]["spec"]["containers"][0]
    assert {"name": "PAGEFLEET_CACHE", "value": "/cache"} in c["env"]
    assert {"name": "cache", "mountPath": "/cache", "readOnly": False} in c["volumeMounts"]
    assert not [o for o in rendered(cases()["full"]) if o["kind"] == "PersistentVolumeClaim"]
