"""kmock's Kubernetes emulator, made good enough for kopf and kubernetes_asyncio.

kmock 0.8 stores and serves objects as it gets them. A controller needs a few more API-server behaviours,
which `KubeEmulator` adds around kmock's own storage and patch logic:

- metadata the API server stamps: uid, creationTimestamp, namespace (from the URL), a name from
  generateName (kopf's Events use it), generation (1, then +1 when a write changes spec), and a
  resourceVersion from one counter, bumped by every write, so kopf's consistency checks see their patches
  come back through the watch;
- a JSON-patch `test` that fails answers 422, as kopf's optimistic concurrency on finalizers expects
  (kmock answers 500);
- 201 on create;
- a list answers the current resourceVersion, and a watch from it replays only the objects changed since
  (kmock replays everything on every watch); the watch subscribes to changes before it snapshots the
  objects, so no write falls in between;
- equality-based labelSelector (`k=v`, `k!=v`, `k`, `!k`) on list and watch.

All writes are serialized by one lock, so the stamps are computed against the object they apply to.
Not done: PUT, set-based selectors, fieldSelector, garbage collection through ownerReferences, CRD schema
validation and pruning, addressing namespaces themselves (kmock's path parser reads /api/v1/namespaces as a
namespace prefix: kopf has to run cluster-wide against it). kmock also stores a write that a test's own
reaction answers with an error.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import secrets
import uuid
from collections.abc import AsyncIterator, Iterable, Mapping
from pathlib import Path
from typing import Any

import aiohttp.web
import attrs
import jsonpatch
import kmock
from kmock._internal import dicts as kmock_dicts  # kmock's own merge/JSON patch, to compute what it will store

WRITES = (kmock.action.CREATE, kmock.action.UPDATE, kmock.action.DELETE)

# What the operator touches: declared so that listing an empty collection answers 200, not 404.
BUILTINS = {
    "v1/pods": "Pod", "v1/services": "Service", "v1/configmaps": "ConfigMap", "v1/serviceaccounts": "ServiceAccount",
    "v1/persistentvolumeclaims": "PersistentVolumeClaim", "v1/events": "Event", "apps/v1/deployments": "Deployment",
    "rbac.authorization.k8s.io/v1/roles": "Role", "rbac.authorization.k8s.io/v1/rolebindings": "RoleBinding",
}
CRDS = kmock.resource("apiextensions.k8s.io/v1/customresourcedefinitions")
NAMESPACES = kmock.resource("v1/namespaces")


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def label_selector_matches(labels: Mapping[str, str] | None, selector: str | None) -> bool:
    labels = labels or {}
    for term in (t.strip() for t in (selector or "").split(",")):
        if not term:
            continue
        if "!=" in term:
            key, value = term.split("!=", 1)
            ok = labels.get(key.strip()) != value.strip()
        elif "=" in term:
            key, value = term.replace("==", "=").split("=", 1)
            ok = labels.get(key.strip()) == value.strip()
        elif " in " in term or " notin " in term:
            raise NotImplementedError(f"set-based label selectors are not emulated: {term!r}")
        elif term.startswith("!"):
            ok = term[1:].strip() not in labels
        else:
            ok = term in labels
        if not ok:
            return False
    return True


def _status(code: int, reason: str, message: str) -> aiohttp.web.Response:
    return aiohttp.web.json_response({"apiVersion": "v1", "kind": "Status", "metadata": {}, "status": "Failure",
                                      "code": code, "reason": reason, "message": message}, status=code)


@attrs.define(kw_only=True)
class KubeEmulator(kmock.KubernetesEmulator):
    _revision: int = attrs.field(default=0, init=False)
    _write_lock: asyncio.Lock = attrs.field(factory=asyncio.Lock, init=False)

    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()
        for key, kind in BUILTINS.items():
            self.resources[key] = kmock.ResourceInfo(kind=kind, namespaced=True, singular=kind.lower(),
                                                     verbs={"get", "list", "watch", "create", "patch", "delete"})
        # kopf waits for namespaces in discovery; served only there (see the module docstring)
        self.resources[NAMESPACES] = kmock.ResourceInfo(kind="Namespace", namespaced=False, singular="namespace",
                                                        verbs={"get", "list", "watch"})

    def add_crd(self, crd: Mapping[str, Any]) -> None:
        """Store the CRD (kopf watches CRDs) and serve its resource in discovery, with its status subresource."""
        spec = crd["spec"]
        names = spec["names"]
        for version in spec["versions"]:
            self.resources[f"{spec['group']}/{version['name']}/{names['plural']}"] = kmock.ResourceInfo(
                kind=names["kind"], singular=names.get("singular"), namespaced=spec["scope"] == "Namespaced",
                shortnames=names.get("shortNames", ()), categories=names.get("categories", ()),
                subresources=set(version.get("subresources", {})),
                verbs={"get", "list", "watch", "create", "patch", "delete"})
        self.objects[CRDS, None, crd["metadata"]["name"]] = self._stamped_new(dict(crd), None)

    def _next_revision(self) -> str:
        self._revision += 1
        return str(self._revision)

    def _stamped_new(self, obj: dict[str, Any], namespace: str | None) -> dict[str, Any]:
        meta = obj.setdefault("metadata", {})
        if not meta.get("name") and meta.get("generateName"):
            meta["name"] = meta["generateName"] + secrets.token_hex(3)
        if namespace:
            meta.setdefault("namespace", namespace)
        meta.update(uid=str(uuid.uuid4()), creationTimestamp=_now(), generation=1,
                    resourceVersion=self._next_revision())
        return obj

    def _object(self, request: kmock.Request) -> kmock.Object | None:
        key = (request.resource, request.namespace, request.name)
        return self.objects[key] if key in self.objects else None

    def _stamp_update(self, request: kmock.Request) -> aiohttp.web.StreamResponse | None:
        """Add resourceVersion (and generation) to the patch itself, so that kmock stores and announces the
        stamped object in one version; or answer 422 for a failing JSON-patch test."""
        obj = self._object(request)
        if obj is None or obj.deleted:
            return None  # kmock answers 404
        current = obj.raw
        try:
            patched = kmock_dicts.patch_dict(current, request.data)
        except (jsonpatch.JsonPatchTestFailed, jsonpatch.JsonPatchConflict) as e:
            return _status(422, "Invalid", f"the JSON patch does not apply: {e}")
        stamps = {"resourceVersion": self._next_revision()}
        if request.subresource is None and patched.get("spec") != current.get("spec"):
            stamps["generation"] = int(current.get("metadata", {}).get("generation") or 0) + 1
        if isinstance(request.data, list):
            request.data.extend({"op": "add", "path": f"/metadata/{k}", "value": v} for k, v in stamps.items())
        else:
            if not isinstance(request.data.get("metadata"), dict):
                request.data["metadata"] = {}
            request.data["metadata"].update(stamps)
        return None

    async def _handle(self, request: kmock.Request) -> aiohttp.web.StreamResponse:
        if request.resource is None or request.action not in WRITES:
            return await super()._handle(request)
        async with self._write_lock:
            if request.action == kmock.action.CREATE and isinstance(request.data, dict):
                self._stamped_new(request.data, request.namespace)
            elif request.action == kmock.action.UPDATE and request.name is not None:
                if (refusal := self._stamp_update(request)) is not None:
                    return refusal
            elif request.action == kmock.action.DELETE and request.name is not None:
                obj = self._object(request)
                meta = {} if obj is None or obj.deleted else obj.raw.get("metadata", {})
                if meta.get("finalizers") and not meta.get("deletionTimestamp"):
                    # kmock sets deletionTimestamp and announces MODIFIED: give that version a new revision
                    obj.patch({"metadata": {"resourceVersion": self._next_revision()}})
            response = await super()._handle(request)
        if request.action == kmock.action.CREATE and response.status == 200 and not response.prepared:
            response.set_status(201)
        return response

    def _matching(self, request: kmock.Request) -> list[dict[str, Any]]:
        selector = request.params.get("labelSelector")
        return [obj.raw for (resource, namespace, name), obj in list(self.objects.items())
                if resource == request.resource and not obj.deleted
                and (request.namespace is None or namespace == request.namespace)
                and (request.name is None or name == request.name)
                and label_selector_matches(obj.raw.get("metadata", {}).get("labels"), selector)]

    async def _serve_list(self, request: kmock.Request) -> dict[str, Any]:
        if request.resource not in self._get_resources():
            raise kmock.KubernetesResourceNotFoundError()
        async with self._write_lock:  # the items and the revision they are at, consistently
            return {"apiVersion": "v1", "kind": "List", "metadata": {"resourceVersion": str(self._revision)},
                    "items": self._matching(request)}

    async def _serve_watch(self, request: kmock.Request) -> AsyncIterator[Any]:
        yield b""  # send the headers now: a watch may stay silent for long
        since = request.params.get("resourceVersion", "")
        after = int(since) if since.isdigit() else -1
        selector = request.params.get("labelSelector")
        bus = self._buses[request.resource]
        async with self._write_lock:  # writes announce under this lock: mark + snapshot see the same state
            mark = await bus.mark()
            snapshot = self._matching(request)
        try:
            for raw in snapshot:
                if int(raw.get("metadata", {}).get("resourceVersion") or 0) > after:
                    yield {"type": "ADDED", "object": raw}
            async for event in bus.stream(since=mark):
                meta = event.get("object", {}).get("metadata", {})
                if ((request.namespace is None or meta.get("namespace") == request.namespace)
                        and (request.name is None or meta.get("name") == request.name)
                        and label_selector_matches(meta.get("labels"), selector)):
                    yield event
        finally:
            await bus.unmark(mark)


def kubeconfig(path: Path, server: str, namespace: str = "default") -> Path:
    path.write_text(
        "apiVersion: v1\nkind: Config\ncurrent-context: kmock\n"
        f"clusters: [{{name: kmock, cluster: {{server: '{server}'}}}}]\n"
        "users: [{name: kmock, user: {token: kmock-token}}]\n"
        f"contexts: [{{name: kmock, context: {{cluster: kmock, user: kmock, namespace: {namespace}}}}}]\n")
    return path


@contextlib.asynccontextmanager
async def serving(crds: Iterable[Mapping[str, Any]] = ()) -> AsyncIterator[tuple[KubeEmulator, str]]:
    """The emulator over HTTP on a free local port: (emulator, server URL)."""
    async with KubeEmulator() as k8s, kmock.Server(k8s) as server:
        for crd in crds:
            k8s.add_crd(crd)
        yield k8s, str(server.url).rstrip("/")
