"""The InferenceService CustomResourceDefinition, generated from `operator/spec.py`.

Pydantic writes JSON Schema (2020-12); Kubernetes wants a *structural*
OpenAPI v3.0 schema: no $ref, `nullable` instead of `anyOf [X, null]`,
boolean `exclusiveMinimum`, and `x-kubernetes-preserve-unknown-fields` where
a field is free-form (resources, tolerations, env). `crds/inferenceservice.yaml`
is this output, committed; a test fails when the two differ, so the CRD can
never drift from the model.
"""

from __future__ import annotations

from typing import Any

import yaml

from pagefleet.operator.spec import GROUP, KIND, PLURAL, SHORT_NAMES, SINGULAR, VERSION, InferenceServiceSpec

_DROP = {"title", "default", "$schema"}


def _structural(node: Any, defs: dict[str, Any]) -> Any:
    if isinstance(node, list):
        return [_structural(n, defs) for n in node]
    if not isinstance(node, dict):
        return node
    if "$ref" in node:
        target = defs[node["$ref"].rsplit("/", 1)[1]]
        merged = {**target, **{k: v for k, v in node.items() if k != "$ref"}}
        return _structural(merged, defs)
    options = node.get("anyOf")
    if options is not None:
        rest = [o for o in options if o.get("type") != "null"]
        if len(rest) == 1:  # Optional[X]
            merged = {**rest[0], **{k: v for k, v in node.items() if k != "anyOf"}}
            if len(rest) != len(options):
                merged["nullable"] = True
            return _structural(merged, defs)
    out: dict[str, Any] = {}
    for key, value in node.items():
        if key in _DROP or key == "$defs":
            continue
        if key == "properties":
            out[key] = {name: _structural(v, defs) for name, v in value.items()}
        elif key in ("exclusiveMinimum", "exclusiveMaximum") and not isinstance(value, bool):
            bound = "minimum" if key == "exclusiveMinimum" else "maximum"
            out[bound], out[key] = value, True
        elif key == "const":
            out["enum"] = [value]
        else:
            out[key] = _structural(value, defs)
    if out.get("type") == "object" and "properties" not in out:
        add = out.get("additionalProperties")
        if add is True or add == {} or add is None:
            # free-form (e.g. Kubernetes ResourceRequirements): keep what the user wrote
            out.pop("additionalProperties", None)
            out["x-kubernetes-preserve-unknown-fields"] = True
    if out.get("type") == "object" and "properties" in out:
        out.pop("additionalProperties", None)  # unknown fields are pruned by the API server anyway
    if not out.get("type") and "enum" not in out and "x-kubernetes-preserve-unknown-fields" not in out:
        out["x-kubernetes-preserve-unknown-fields"] = True
    return out


def spec_schema() -> dict[str, Any]:
    raw = InferenceServiceSpec.model_json_schema(by_alias=True, mode="validation")
    return _structural(raw, raw.get("$defs", {}))


_STATUS_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "observedGeneration": {"type": "integer"},
        "url": {"type": "string", "description": "The router Service's in-cluster URL."},
        "conditions": {
            "type": "array",
            "x-kubernetes-list-type": "map",
            "x-kubernetes-list-map-keys": ["type"],
            "items": {
                "type": "object",
                "required": ["type", "status"],
                "properties": {
                    "type": {"type": "string"},
                    "status": {"type": "string", "enum": ["True", "False", "Unknown"]},
                    "reason": {"type": "string"},
                    "message": {"type": "string"},
                    "lastTransitionTime": {"type": "string", "format": "date-time"},
                    "observedGeneration": {"type": "integer"},
                },
            },
        },
        "pools": {
            "type": "object",
            "additionalProperties": {
                "type": "object",
                "properties": {
                    "desiredReplicas": {"type": "integer"},
                    "readyReplicas": {"type": "integer"},
                    "lastScaling": {
                        "type": "object",
                        "properties": {
                            "time": {"type": "string", "format": "date-time"},
                            "from": {"type": "integer"},
                            "to": {"type": "integer"},
                            "reason": {"type": "string"},
                            "metrics": {"type": "object", "additionalProperties": {"type": "number"}},
                        },
                    },
                },
            },
        },
        "readyReplicas": {"type": "integer", "description": "Ready engine replicas over all pools."},
    },
    # kopf keeps its own bookkeeping under status (e.g. handler progress)
    "x-kubernetes-preserve-unknown-fields": True,
}


def crd_manifest() -> dict[str, Any]:
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"{PLURAL}.{GROUP}"},
        "spec": {
            "group": GROUP,
            "scope": "Namespaced",
            "names": {"kind": KIND, "plural": PLURAL, "singular": SINGULAR, "shortNames": SHORT_NAMES,
                      "categories": ["pagefleet"]},
            "versions": [{
                "name": VERSION,
                "served": True,
                "storage": True,
                "subresources": {"status": {}},
                "additionalPrinterColumns": [
                    {"name": "Model", "type": "string", "jsonPath": ".spec.model.uri"},
                    {"name": "Ready", "type": "integer", "jsonPath": ".status.readyReplicas"},
                    {"name": "URL", "type": "string", "jsonPath": ".status.url"},
                    {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
                ],
                "schema": {"openAPIV3Schema": {
                    "type": "object",
                    "description": "An LLM served by pools of pagefleet engine replicas behind a prefix-aware "
                                   "router, autoscaled from the engines' queue and KV-cache metrics.",
                    "required": ["spec"],
                    "properties": {
                        "apiVersion": {"type": "string"},
                        "kind": {"type": "string"},
                        "metadata": {"type": "object"},
                        "spec": spec_schema(),
                        "status": _STATUS_SCHEMA,
                    },
                }},
            }],
        },
    }


def crd_yaml() -> str:
    header = "# Generated by `pagefleet crd` from operator/spec.py; do not edit by hand.\n"
    return header + yaml.safe_dump(crd_manifest(), sort_keys=False, width=100)


def _type_name(prop: dict[str, Any]) -> str:
    if "enum" in prop:
        return " \\| ".join(f"`{v}`" for v in prop["enum"])
    t = prop.get("type", "any")
    if t == "array":
        return f"list of {_type_name(prop.get('items', {}))}"
    if t == "object" and "properties" not in prop:
        return "object"
    return t


def reference_markdown() -> str:
    """docs/inferenceservice.md: every spec field with its type, default and meaning,
    generated from the models (a test keeps the committed file current)."""
    from pydantic import BaseModel

    from pagefleet.operator.spec import InferenceServiceSpec

    lines = ["# InferenceService reference", "",
             "Generated by `python -m pagefleet.operator.crd` from `operator/spec.py`; do not edit by hand.",
             f"`apiVersion: {GROUP}/{VERSION}`, `kind: {KIND}` (short name `{SHORT_NAMES[0]}`). "
             "Fields are camelCase in YAML.", ""]

    def walk(model: type[BaseModel], prefix: str) -> None:
        schema = _structural(model.model_json_schema(by_alias=True), model.model_json_schema(by_alias=True)
                             .get("$defs", {}))
        nested: list[tuple[str, type[BaseModel]]] = []
        lines.extend([f"## `{prefix or 'spec'}`", "", "| field | type | default | meaning |", "|---|---|---|---|"])
        for name, field in model.model_fields.items():
            alias = field.alias or name
            prop = schema["properties"][alias]
            default = "required" if field.is_required() else (
                "" if field.default_factory is not None else f"`{json_default(field.default)}`")
            lines.append(f"| `{alias}` | {_type_name(prop)} | {default} | {field.description or ''} |")
            inner = field.annotation
            for cand in getattr(inner, "__args__", (inner,)):
                item = getattr(cand, "__args__", (cand,))[0] if getattr(cand, "__origin__", None) is list else cand
                if isinstance(item, type) and issubclass(item, BaseModel):
                    nested.append((f"{prefix}.{alias}" if prefix else f"spec.{alias}", item))
        lines.append("")
        for path, sub in nested:
            walk(sub, path)

    def json_default(v: Any) -> str:
        return "null" if v is None else str(v).lower() if isinstance(v, bool) else str(v)

    walk(InferenceServiceSpec, "")
    return "\n".join(lines).rstrip() + "\n"


if __name__ == "__main__":
    import sys

    sys.stdout.write(reference_markdown())
