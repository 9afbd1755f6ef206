"""The InferenceService custom resource, as pydantic models.

One source of truth for three things: validating a spec (the operator and
`pagefleet up` both load specs through `InferenceService.model_validate`), the
CRD's OpenAPI schema (`operator/crd.py` generates it from these models), and
the defaults every consumer sees. Field names are camelCase in YAML (aliases)
and snake_case in Python.

Enums list settings the engine does not implement yet (quantization,
speculative decoding, prefill/decode roles) so that specs written for them are
valid documents; `unsupported_features` says which ones a spec asks for, and
the operator reports them as a condition instead of starting pods that fail.
"""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic.alias_generators import to_camel

from pagefleet import __version__
from pagefleet.operator.autoscale import ScalingParams

GROUP = "pagefleet.dev"
VERSION = "v1alpha1"
KIND = "InferenceService"
PLURAL = "inferenceservices"
SINGULAR = "inferenceservice"
SHORT_NAMES = ["pfis"]  # not KServe's `isvc`: both CRDs can live in one cluster
API_VERSION = f"{GROUP}/{VERSION}"
DEFAULT_IMAGE = f"ghcr.io/pagefleet/pagefleet:{__version__}"

_DNS_LABEL = r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$"
# Kubernetes quantities ("2Gi") and the engine's byte sizes ("2GiB") both read as bytes.
_BYTES = r"^[0-9]+(\.[0-9]+)?(Ki|Mi|Gi|Ti|K|M|G|T|KiB|MiB|GiB|TiB|KB|MB|GB|TB|B)?$"
_MODEL_SCHEMES = ("hf://", "pagefleet://", "/")


class _Spec(BaseModel):
    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="forbid")


# ---- model ------------------------------------------------------------------------------------------


class ModelCacheSpec(_Spec):
    """A volume shared by the pool's replicas, so the weights are fetched once."""
    size: str = Field("20Gi", pattern=_BYTES, description="Size of the cache PersistentVolumeClaim.")
    storage_class_name: str | None = Field(None, description="StorageClass of the cache claim (cluster default "
                                                              "if unset); must support ReadWriteMany for >1 node.")


class ModelSpec(_Spec):
    uri: str = Field(..., min_length=1, description="hf://ORG/NAME (downloaded), pagefleet://NAME (a model from "
                                                    "`pagefleet models list`), or an absolute path (an HF "
                                                    "directory or a .gguf file; in a cluster, inside the volume "
                                                    "given by `pvc`, mounted at /models).")
    served_name: str | None = Field(None, min_length=1, max_length=256,
                                    description="The name clients send as `model` (default: the resource's name).")
    revision: str | None = Field(None, description="Branch, tag or commit of an hf:// model.")
    pvc: str | None = Field(None, pattern=_DNS_LABEL, description="An existing PersistentVolumeClaim holding the "
                                                                  "model, mounted read-only at /models.")
    cache: ModelCacheSpec = Field(default_factory=ModelCacheSpec,
                                  description="Shared download cache for hf:// and pagefleet:// models.")

    @field_validator("uri")
    @classmethod
    def _known_scheme(cls, uri: str) -> str:
        if not uri.startswith(_MODEL_SCHEMES):
            raise ValueError(f"unknown model scheme in {uri!r}: use hf://ORG/NAME, pagefleet://NAME or an "
                             "absolute path")
        if uri.startswith("hf://") and not re.fullmatch(r"hf://[\w.-]+/[\w.-]+", uri):
            raise ValueError(f"{uri!r}: expected hf://ORG/NAME")
        return uri

    @model_validator(mode="after")
    def _source_is_consistent(self) -> ModelSpec:
        if self.revision and not self.uri.startswith("hf://"):
            raise ValueError("model.revision applies to hf:// models only")
        return self


# ---- engine -----------------------------------------------------------------------------------------


class SpeculativeSpec(_Spec):
    method: Literal["ngram", "draft"] = Field(..., description="ngram: prompt lookup; draft: a smaller model "
                                                               "with the same vocabulary.")
    draft_model: str | None = Field(None, description="The draft model's URI (method: draft).")
    num_tokens: int = Field(3, ge=1, le=16, description="Tokens proposed per step.")

    @model_validator(mode="after")
    def _draft_needs_model(self) -> SpeculativeSpec:
        if (self.method == "draft") != (self.draft_model is not None):
            raise ValueError("speculative.draftModel is required with method: draft and not allowed otherwise")
        return self


class EngineSpec(_Spec):
    image: str = Field(DEFAULT_IMAGE, min_length=1, description="Container image of the engine (and router).")
    image_pull_policy: Literal["Always", "IfNotPresent", "Never"] = "IfNotPresent"
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="Weights and KV dtype (auto: bf16 on CPUs with native bf16, else fp32; on GPU the "
                            "checkpoint's).")
    block_size: Literal[8, 16, 32, 64] = Field(16, description="Tokens per KV-cache block.")
    kv_cache_memory: str = Field("2GiB", pattern=_BYTES, description="KV cache budget per replica.")
    max_num_seqs: int = Field(256, ge=1, description="Max concurrent sequences per replica.")
    max_num_batched_tokens: int = Field(2048, ge=16, description="Token budget per engine step.")
    max_model_len: int | None = Field(None, ge=16, description="Max prompt + output tokens (default: the model's).")
    prefix_caching: bool = Field(True, description="Reuse KV blocks of shared prompt prefixes across requests.")
    quantization: Literal["none", "int8", "int4", "fp8"] = Field(
        "none", description="Weight-only quantization of the decoder layers: int8 (CPU); int4 and fp8 are not "
                            "implemented yet.")
    kv_cache_dtype: Literal["auto", "int8", "fp8"] = Field("auto", description="KV cache quantization (not "
                                                                              "implemented yet).")
    speculative: SpeculativeSpec | None = Field(None, description="Speculative decoding (not implemented yet).")
    max_queue: int | None = Field(None, ge=1, description="Answer 429 beyond this many waiting requests.")
    threads: int | None = Field(None, ge=1, description="CPU threads for torch (default: the CPU limit).")
    resources: dict[str, Any] | None = Field(None, description="Kubernetes ResourceRequirements of the engine "
                                                               "container.")
    node_selector: dict[str, str] = Field(default_factory=dict, description="Pod nodeSelector.")
    tolerations: list[dict[str, Any]] = Field(default_factory=list, description="Pod tolerations.")
    extra_args: list[str] = Field(default_factory=list, description="Appended to `pagefleet engine`.")
    env: list[dict[str, Any]] = Field(default_factory=list, description="Kubernetes EnvVar list.")
    shutdown_timeout_seconds: int = Field(30, ge=1, le=3600, description="Drain time on SIGTERM; the pod's grace "
                                                                         "period is this plus 10 s.")


# ---- pools and router -------------------------------------------------------------------------------


class AutoscalingSpec(_Spec):
    model_config = ConfigDict(json_schema_extra={"x-kubernetes-validations": [
        {"rule": "self.minReplicas <= self.maxReplicas", "message": "minReplicas must be <= maxReplicas"}]})

    min_replicas: int = Field(1, ge=0, description="Fewest replicas (also the count at creation).")
    max_replicas: int = Field(1, ge=1, description="Most replicas.")
    target_waiting_per_replica: float = Field(2.0, gt=0, description="Waiting requests per replica to aim for.")
    target_kv_cache_usage: float = Field(0.8, gt=0, le=1, alias="targetKVCacheUsage",
                                         description="Mean KV-cache usage (0-1] to aim for.")
    tolerance: float = Field(0.1, ge=0, lt=1, description="No change while metrics are within this fraction of "
                                                          "their targets.")
    scale_up_window_seconds: float = Field(0, ge=0, description="Scale up only to the lowest recommendation of "
                                                                "this window.")
    scale_down_window_seconds: float = Field(300, ge=0, description="Scale down only to the highest "
                                                                    "recommendation of this window.")
    scale_up_step: int = Field(4, ge=1, description="Max replicas added per decision.")
    scale_down_step: int = Field(1, ge=1, description="Max replicas removed per decision.")

    @model_validator(mode="after")
    def _min_le_max(self) -> AutoscalingSpec:
        if self.min_replicas > self.max_replicas:
            raise ValueError(f"minReplicas ({self.min_replicas}) must be <= maxReplicas ({self.max_replicas})")
        return self

    def params(self) -> ScalingParams:
        """The policy's parameters (operator/autoscale.py) for this pool."""
        return ScalingParams(min_replicas=self.min_replicas, max_replicas=self.max_replicas,
                             target_waiting_per_replica=self.target_waiting_per_replica,
                             target_kv_cache_usage=self.target_kv_cache_usage, tolerance=self.tolerance,
                             scale_up_window_s=self.scale_up_window_seconds,
                             scale_down_window_s=self.scale_down_window_seconds,
                             scale_up_step=self.scale_up_step, scale_down_step=self.scale_down_step)


class PoolSpec(_Spec):
    name: str = Field(..., pattern=_DNS_LABEL, max_length=20, description="Short DNS label; part of object names.")
    role: Literal["Unified", "Prefill", "Decode"] = Field("Unified", description="Prefill/Decode are reserved "
                                                                                  "for disaggregation.")
    autoscaling: AutoscalingSpec = Field(default_factory=AutoscalingSpec, description="Replica bounds and the "
                                                                                      "policy's targets.")


class RouterSpec(_Spec):
    replicas: int = Field(1, ge=1, description="Router pods.")
    policy: Literal["prefix", "least-load", "round-robin", "session"] = Field(
        "prefix", description="How a replica is picked (README, Router).")
    prefix_weight: float = Field(3.0, ge=0, description="Requests of queue a full prefix match is worth on an "
                                                        "idle pool.")
    prefix_weight_per_load: float = Field(0.5, ge=0, description="Extra worth of a full match per request of "
                                                                 "mean load.")
    load_cap_ratio: float = Field(1.5, ge=1, description="No affinity above ratio * mean load + slack.")
    load_cap_slack: float = Field(2.0, ge=0, description="See loadCapRatio.")
    session_header: str = Field("x-session-id", min_length=1, description="Header naming the session (policy "
                                                                            "session).")
    resources: dict[str, Any] | None = Field(None, description="Kubernetes ResourceRequirements of the router.")


class InferenceServiceSpec(_Spec):
    model: ModelSpec = Field(..., description="What to serve and where its weights come from.")
    engine: EngineSpec = Field(default_factory=EngineSpec, description="Settings of every engine replica.")
    pools: list[PoolSpec] = Field(default_factory=lambda: [PoolSpec(name="main")], min_length=1, max_length=8,
                                  description="Groups of engine replicas, each autoscaled (default: one pool "
                                              "`main`).",
                                  json_schema_extra={"x-kubernetes-list-type": "map",
                                                     "x-kubernetes-list-map-keys": ["name"]})
    router: RouterSpec = Field(default_factory=RouterSpec, description="The router in front of the pools.")

    @model_validator(mode="after")
    def _unique_pools(self) -> InferenceServiceSpec:
        names = [p.name for p in self.pools]
        if len(set(names)) != len(names):
            raise ValueError(f"pools: names must be unique, got {names}")
        return self


# ---- the resource -------------------------------------------------------------------------------------


class ObjectMeta(BaseModel):
    model_config = ConfigDict(extra="allow")
    name: str = Field(..., pattern=_DNS_LABEL, max_length=40)
    namespace: str | None = None


class InferenceService(BaseModel):
    """A whole document, as in a YAML file (`pagefleet up` reads these)."""
    model_config = ConfigDict(populate_by_name=True, extra="forbid")
    api_version: Literal["pagefleet.dev/v1alpha1"] = Field(..., alias="apiVersion")
    kind: Literal["InferenceService"]
    metadata: ObjectMeta
    spec: InferenceServiceSpec
    status: dict[str, Any] | None = None

    def served_name(self) -> str:
        return self.spec.model.served_name or self.metadata.name


def cluster_problems(spec: InferenceServiceSpec) -> list[str]:
    """What a spec that runs locally (`pagefleet up`) still lacks to run in a cluster."""
    if spec.model.uri.startswith("/") and not spec.model.pvc:
        return ["model.uri is a path: set model.pvc to the PersistentVolumeClaim that holds it"]
    return []


def unsupported_features(spec: InferenceServiceSpec) -> list[str]:
    """Valid settings this version of the engine cannot run yet (reported, not started)."""
    out = []
    if spec.engine.quantization not in ("none", "int8"):
        out.append(f"engine.quantization: {spec.engine.quantization}")
    if spec.engine.kv_cache_dtype != "auto":
        out.append(f"engine.kvCacheDtype: {spec.engine.kv_cache_dtype}")
    if spec.engine.speculative is not None:
        out.append(f"engine.speculative: {spec.engine.speculative.method}")
    out += [f"pools[{p.name}].role: {p.role}" for p in spec.pools if p.role != "Unified"]
    return out
