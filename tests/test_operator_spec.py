"""The InferenceService spec model and the CRD generated from it."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from pydantic import ValidationError

from pagefleet.operator.crd import crd_manifest, crd_yaml
from pagefleet.operator.spec import InferenceService, InferenceServiceSpec, cluster_problems, unsupported_features

ROOT = Path(__file__).resolve().parent.parent


def doc(**spec) -> dict:
    return {"apiVersion": "pagefleet.dev/v1alpha1", "kind": "InferenceService", "metadata": {"name": "qwen"},
            "spec": {"model": {"uri": "pagefleet://qwen2.5-coder-0.5b-instruct"}, **spec}}


def test_committed_crd_is_the_generated_one() -> None:
    committed = (ROOT / "crds/inferenceservice.yaml").read_text()
    assert committed == crd_yaml(), "stale: run `pagefleet crd > crds/inferenceservice.yaml`"


def test_defaults_and_aliases() -> None:
    isvc = InferenceService.model_validate(doc())
    s = isvc.spec
    assert isvc.served_name() == "qwen"
    assert [p.name for p in s.pools] == ["main"] and s.pools[0].role == "Unified"
    assert s.pools[0].autoscaling.min_replicas == 1 and s.engine.block_size == 16 and s.router.policy == "prefix"
    dumped = s.model_dump(by_alias=True)
    assert "kvCacheMemory" in dumped["engine"] and "targetKVCacheUsage" in dumped["pools"][0]["autoscaling"]
    assert InferenceServiceSpec.model_validate(dumped) == s  # round trip through the YAML names


def test_autoscaling_spec_feeds_the_policy() -> None:
    from pagefleet.operator.autoscale import PodMetrics, decide

    spec = InferenceService.model_validate(doc(pools=[{"name": "main", "autoscaling": {
        "minReplicas": 1, "maxReplicas": 3, "targetWaitingPerReplica": 1, "scaleUpStep": 1}}])).spec
    params = spec.pools[0].autoscaling.params()
    assert (params.min_replicas, params.max_replicas, params.scale_up_step) == (1, 3, 1)
    d = decide(params, 1, [PodMetrics(waiting=6, running=4, kv_usage=0.3)], (), now=0.0)
    assert d.replicas == 2 and "scale up" in d.reason  # wanted 6, one step at a time


@pytest.mark.parametrize(("spec", "complaint"), [
    ({"model": {"uri": "s3://bucket/model"}}, "unknown model scheme"),
    ({"model": {"uri": "hf://just-a-name"}}, "hf://ORG/NAME"),
    ({"model": {"uri": "pagefleet://x", "revision": "main"}}, "hf:// models only"),
    ({"engine": {"blockSize": 12}}, "blockSize"),
    ({"engine": {"kvCacheMemory": "lots"}}, "kvCacheMemory"),
    ({"engine": {"quantization": "int3"}}, "quantization"),
    ({"engine": {"speculative": {"method": "draft"}}}, "draftModel"),
    ({"engine": {"speculative": {"method": "ngram", "numTokens": 40}}}, "numTokens"),
    ({"pools": [{"name": "a", "autoscaling": {"minReplicas": 3, "maxReplicas": 2}}]}, "minReplicas"),
    ({"pools": [{"name": "a"}, {"name": "a"}]}, "unique"),
    ({"pools": []}, "pools"),
    ({"pools": [{"name": "Not_A_Label"}]}, "name"),
    ({"router": {"policy": "random"}}, "policy"),
    ({"router": {"loadCapRatio": 0.5}}, "loadCapRatio"),
    ({"engine": {"typo": 1}}, "typo"),
])
def test_invalid_specs_are_rejected_naming_the_field(spec: dict, complaint: str) -> None:
    base = doc()
    merged = {**base["spec"], **spec}
    with pytest.raises(ValidationError, match=complaint):
        InferenceService.model_validate({**base, "spec": merged})


def test_local_paths_need_a_pvc_only_in_a_cluster() -> None:
    local = InferenceService.model_validate(doc(model={"uri": "/models/qwen"})).spec
    assert cluster_problems(local) == ["model.uri is a path: set model.pvc to the PersistentVolumeClaim that holds it"]
    assert cluster_problems(InferenceService.model_validate(doc(model={"uri": "/models/q", "pvc": "w"})).spec) == []


def test_unsupported_features_are_listed_not_rejected() -> None:
    s = InferenceService.model_validate(doc(engine={"quantization": "int4", "speculative": {
        "method": "draft", "draftModel": "pagefleet://qwen2.5-coder-0.5b-instruct"}},
        pools=[{"name": "p", "role": "Prefill"}, {"name": "d", "role": "Decode"}])).spec
    assert unsupported_features(s) == ["engine.quantization: int4", "engine.speculative: draft",
                                       "pools[p].role: Prefill", "pools[d].role: Decode"]
    assert unsupported_features(InferenceService.model_validate(doc()).spec) == []


def _schemas(node):
    """Every schema object under `node` (values of `properties`, `items`, `additionalProperties`)."""
    yield node
    for child in list(node.get("properties", {}).values()) + [node.get("items"), node.get("additionalProperties")]:
        if isinstance(child, dict):
            yield from _schemas(child)


def test_crd_schema_is_structural() -> None:
    """What the API server's structural-schema check rejects: $ref, anyOf/oneOf, JSON Schema
    2020 numeric exclusive bounds, and schema nodes with neither a type nor preserve-unknown."""
    crd = crd_manifest()
    version = crd["spec"]["versions"][0]
    assert crd["spec"]["names"]["shortNames"] == ["pfis"] and version["subresources"] == {"status": {}}
    schema = version["schema"]["openAPIV3Schema"]
    for node in _schemas(schema):
        assert not {"$ref", "anyOf", "oneOf", "allOf", "$defs"} & node.keys(), node
        for bound in ("exclusiveMinimum", "exclusiveMaximum"):
            assert isinstance(node.get(bound, True), bool), node
        assert "type" in node or node.get("x-kubernetes-preserve-unknown-fields"), node
    spec = schema["properties"]["spec"]
    auto = spec["properties"]["pools"]["items"]["properties"]["autoscaling"]
    assert auto["x-kubernetes-validations"][0]["rule"] == "self.minReplicas <= self.maxReplicas"
    assert spec["properties"]["pools"]["x-kubernetes-list-map-keys"] == ["name"]
    assert spec["properties"]["engine"]["properties"]["quantization"]["enum"] == ["none", "int8", "int4", "fp8"]
    assert spec["properties"]["engine"]["properties"]["resources"]["x-kubernetes-preserve-unknown-fields"] is True
    assert spec["required"] == ["model"]


def test_examples_are_valid_specs() -> None:
    examples = sorted((ROOT / "examples").glob("*.yaml"))
    assert examples
    for path in examples:
        for d in yaml.safe_load_all(path.read_text()):
            if d and d.get("kind") == "InferenceService":
                InferenceService.model_validate(d)


def test_committed_reference_is_the_generated_one() -> None:
    from pagefleet.operator.crd import reference_markdown

    assert (ROOT / "docs/inferenceservice.md").read_text() == reference_markdown(), \
        "stale: run `python -m pagefleet.operator.crd > docs/inferenceservice.md`"


def test_examples_validate_against_the_generated_crd_schema() -> None:
    """What the API server checks on `kubectl apply`: the examples against the CRD's own
    openAPIV3Schema (OpenAPI keywords jsonschema does not know are ignored)."""
    import jsonschema

    schema = crd_manifest()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    docs = [d for path in sorted((ROOT / "examples").glob("*.yaml")) + [ROOT / "e2e/tiny-isvc.yaml"]
            for d in yaml.safe_load_all(path.read_text()) if d and d.get("kind") == "InferenceService"]
    assert len(docs) >= 2
    validator = jsonschema.Draft4Validator(schema)  # OpenAPI 3.0 schemas use draft 4's boolean exclusive bounds
    for d in docs:
        validator.validate(d)
    bad = {**docs[0], "spec": {**docs[0]["spec"], "engine": {"blockSize": 12}}}
    with pytest.raises(jsonschema.ValidationError, match="12"):
        validator.validate(bad)
