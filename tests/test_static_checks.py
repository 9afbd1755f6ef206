"""kube-linter-style rules over everything we ship to a cluster: the operator's install
manifests, the objects it renders (quickstart and a full spec), the e2e manifests, and
the Dockerfile. Findings we accept are listed in ALLOWED with the reason."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml
from test_render import FULL

from pagefleet.operator.local import load_file
from pagefleet.operator.render import render_objects
from pagefleet.operator.spec import InferenceService

ROOT = Path(__file__).resolve().parent.parent

# (object name, rule) -> why it is acceptable
ALLOWED = {
    ("coder-router", "memory-limit"): "the full example sets router resources itself (requests only): the "
                                      "user's choice is passed through as written",
    ("make-tiny-model", "probes"): "a Job: runs to completion, nothing to probe",
    ("make-tiny-model", "memory-limit"): "e2e helper Job on a throwaway cluster",
    ("make-tiny-model", "cpu-requests"): "e2e helper Job on a throwaway cluster",
}


def shipped_objects() -> list[dict]:
    objs = [d for d in yaml.safe_load_all((ROOT / "manifests/operator.yaml").read_text()) if d]
    objs += [d for d in yaml.safe_load_all((ROOT / "e2e/tiny-model.yaml").read_text()) if d]
    for isvc in (load_file(ROOT / "examples/quickstart.yaml"), InferenceService.model_validate(FULL)):
        objs += render_objects(isvc.metadata.name, "ns", isvc.spec, isvc.served_name())
    return objs


def pod_spec(obj: dict) -> dict | None:
    if obj["kind"] in ("Deployment", "Job"):
        return obj["spec"]["template"]["spec"]
    return None


def findings() -> list[tuple[str, str, str]]:
    out = []
    for obj in shipped_objects():
        name = obj["metadata"]["name"]
        if obj["kind"] in ("Role", "ClusterRole"):
            for rule in obj["rules"]:
                for key in ("apiGroups", "resources", "verbs"):
                    if "*" in rule.get(key, []):
                        out.append((name, "rbac-wildcard", str(rule)))
                if {"secrets"} & set(rule.get("resources", [])):
                    out.append((name, "rbac-secrets", str(rule)))
        pod = pod_spec(obj)
        if pod is None:
            continue
        psc = pod.get("securityContext", {})
        if not psc.get("runAsNonRoot"):
            out.append((name, "run-as-non-root", ""))
        if pod.get("hostNetwork") or pod.get("hostPID") or pod.get("hostIPC"):
            out.append((name, "host-namespaces", ""))
        for c in pod["containers"]:
            sc = c.get("securityContext", {})
            image = c["image"]
            if image.endswith(":latest") or ":" not in image.rsplit("/", 1)[-1]:
                out.append((name, "latest-tag", image))
            if sc.get("allowPrivilegeEscalation") is not False:
                out.append((name, "privilege-escalation", c["name"]))
            if sc.get("readOnlyRootFilesystem") is not True:
                out.append((name, "writable-root-fs", c["name"]))
            if "ALL" not in sc.get("capabilities", {}).get("drop", []):
                out.append((name, "capabilities", c["name"]))
            if sc.get("privileged"):
                out.append((name, "privileged", c["name"]))
            if not (c.get("livenessProbe") and c.get("readinessProbe")):
                out.append((name, "probes", c["name"]))
            res = c.get("resources", {})
            if "cpu" not in res.get("requests", {}):
                out.append((name, "cpu-requests", c["name"]))
            if "memory" not in res.get("limits", {}):
                out.append((name, "memory-limit", c["name"]))
    return out


def test_manifests_pass_the_rules_or_are_justified() -> None:
    unexplained = [f for f in findings() if (f[0], f[1]) not in ALLOWED]
    assert not unexplained, unexplained


def test_the_rules_can_fail() -> None:
    bad = {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "bad"}, "spec": {"template": {"spec": {
        "containers": [{"name": "c", "image": "x:latest", "securityContext": {"privileged": True}}]}}}}
    import test_static_checks as me

    original = me.shipped_objects
    try:
        me.shipped_objects = lambda: [bad]
        rules = {rule for _, rule, _ in me.findings()}
    finally:
        me.shipped_objects = original
    assert {"run-as-non-root", "latest-tag", "privilege-escalation", "writable-root-fs", "capabilities",
            "privileged", "probes", "cpu-requests", "memory-limit"} <= rules


def test_dockerfile_rules() -> None:
    text = (ROOT / "Dockerfile").read_text()
    instructions = [ln.split()[0] for ln in text.splitlines() if ln.strip() and not ln.lstrip().startswith("#")
                    and not ln.startswith((" ", "\t"))]
    assert "ADD" not in instructions  # COPY only: no remote fetches or auto-extraction
    users = re.findall(r"^USER\s+(\S+)", text, re.M)
    assert users and users[-1].split(":")[0] not in ("root", "0")  # runs as non-root
    assert re.search(r"^ARG BASE=\S+:\S+", text, re.M)  # the base image is tagged
    for pip in re.findall(r"pip install[^\n]*", text):
        assert "--no-cache-dir" in pip, pip


@pytest.mark.parametrize("path", sorted((ROOT / "manifests").glob("*.yaml")) + [ROOT / "e2e/tiny-model.yaml"])
def test_shipped_yaml_validates_against_kubernetes(path: Path) -> None:
    import kubernetes_validate

    for d in yaml.safe_load_all(path.read_text()):
        if d:
            kubernetes_validate.validate(d, "1.30", strict=True)
