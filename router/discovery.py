"""Kubernetes discovery: the URLs of the ready engine pods behind a Service, kept current by list + watch.

The router reads EndpointSlices (discovery.k8s.io/v1) rather than Pods: the endpoints controller has already
joined the Service's selector, the pods' readiness and the port mapping, so "ready" here means exactly what
kube-proxy would send traffic to.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from kubernetes_asyncio import client, config

log = logging.getLogger(__name__)

SERVICE_NAME_LABEL = "kubernetes.io/service-name"
MAX_BACKOFF_SECONDS = 30.0
LIST_TIMEOUT_SECONDS = 60.0  # the API server's own default request timeout: a list that takes longer has hung

# Namespaces and Service names are DNS-1123 labels; Service port names are too.
_DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")


@dataclass(frozen=True)
class ServiceRef:
    namespace: str
    name: str
    port: int | str | None = None  # a port number, a port name, or None = the slice's first port
    scheme: str = "http"

    @classmethod
    def parse(cls, text: str) -> ServiceRef:
        """'NAMESPACE/NAME', 'NAMESPACE/NAME:PORT' (PORT a number or a port name). ValueError with a clear message
        otherwise."""
        expected = "expected NAMESPACE/NAME or NAMESPACE/NAME:PORT, e.g. 'serving/llama-pool:http'"
        namespace, slash, rest = text.strip().partition("/")
        name, colon, port_text = rest.partition(":")
        if not slash or not namespace or not name or (colon and not port_text):
            raise ValueError(f"invalid service reference {text!r}: {expected}")
        for what, value in (("namespace", namespace), ("service name", name)):
            if not _DNS_LABEL.fullmatch(value):
                raise ValueError(
                    f"invalid service reference {text!r}: {what} {value!r} is not a DNS label "
                    "(lowercase letters, digits and '-', at most 63 characters)"
                )
        port: int | str | None = None
        if port_text.isdigit():
            port = int(port_text)
            if not 1 <= port <= 65535:
                raise ValueError(f"invalid service reference {text!r}: port {port} is outside 1-65535")
        elif port_text:
            if not _DNS_LABEL.fullmatch(port_text):
                raise ValueError(
                    f"invalid service reference {text!r}: port {port_text!r} is neither a number nor a port name"
                )
            port = port_text
        return cls(namespace, name, port)

    def __str__(self) -> str:
        return f"{self.namespace}/{self.name}" + (f":{self.port}" if self.port is not None else "")


def _slice_port(ports: Iterable[Mapping], port: int | str | None) -> int | None:
    if isinstance(port, int):
        return port
    for candidate in ports:
        # A null port in a slice means "all ports": there is no single number to send requests to.
        if port is None or candidate.get("name") == port:
            return candidate.get("port")
    return None


def _url(scheme: str, address: str, port: int) -> str:
    host = f"[{address}]" if ":" in address else address
    return f"{scheme}://{host}:{port}"


def ready_endpoint_urls(slices: Iterable[Mapping], port: int | str | None, scheme: str = "http") -> set[str]:
    """Pure: URLs (scheme://ip:port, IPv6 in brackets) of the endpoints that are ready in these
    discovery.k8s.io/v1 EndpointSlice objects, given as plain dicts in the API's JSON shape (camelCase keys).
    Ready = conditions.ready is true, or absent (the API says absent means ready), and not terminating.
    Port selection: port number -> that number; port name -> the slice port with that name; None -> the
    slice's first port. Slices without a matching port contribute nothing. Deduplicate across slices."""
    urls: set[str] = set()
    for endpoint_slice in slices:
        port_number = _slice_port(endpoint_slice.get("ports") or (), port)
        if port_number is None:
            continue
        for endpoint in endpoint_slice.get("endpoints") or ():
            conditions = endpoint.get("conditions") or {}
            if conditions.get("ready") is False or conditions.get("terminating") is True:
                continue
            urls.update(_url(scheme, address, port_number) for address in endpoint.get("addresses") or ())
    return urls


async def default_api_client() -> client.ApiClient:
    # A configuration of our own, so that loading it does not change the process-wide default.
    configuration = client.Configuration()
    try:
        config.load_incluster_config(client_configuration=configuration)
    except config.ConfigException:
        await config.load_kube_config(client_configuration=configuration)
    return client.ApiClient(configuration)


class _ApiStatusError(Exception):
    """A failed API call or a watch ERROR event, with the Status object's code and message."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"HTTP {status}: {message}")
        self.status = status


async def _json_body(response: Any) -> dict[str, Any]:
    # Raw responses (_preload_content=False) keep the API's JSON as is, but leave the status check to us.
    raw = await response.read()
    if not 200 <= response.status <= 299:
        try:
            message = json.loads(raw).get("message")
        except (ValueError, AttributeError):  # a proxy's HTML page, say
            message = None
        raise _ApiStatusError(response.status, message or response.reason or "")
    return json.loads(raw)


class EndpointSliceWatcher:
    """Reports the ready URLs behind one Service, from its EndpointSlices, whenever they change."""

    def __init__(
        self,
        ref: ServiceRef,
        on_change: Callable[[set[str]], None],
        *,
        api_client_factory: Callable[[], Awaitable[Any]] | None = None,
        resync_seconds: float = 300.0,
        backoff_seconds: float = 1.0,
    ) -> None:
        self.ref = ref
        self._on_change = on_change
        self._api_client_factory = api_client_factory or default_api_client
        self._resync_seconds = resync_seconds
        self._backoff_seconds = backoff_seconds
        self._slices: dict[str, Mapping] = {}
        self._urls: set[str] | None = None  # None until the first list, so that the first report always happens
        self._sleep: Callable[[float], Awaitable[Any]] = asyncio.sleep  # tests observe the backoff through it

    async def run(self) -> None:
        """Forever: list EndpointSlices in ref.namespace with label selector kubernetes.io/service-name=ref.name,
        then watch from the list's resourceVersion; keep the current slices by name (ADDED/MODIFIED replace,
        DELETED removes), and call on_change(urls) with the full set of ready URLs every time that set changes
        (also once after the initial list, even if empty). On watch expiry (410 Gone) or connection errors:
        log, sleep with capped exponential backoff (backoff_seconds doubling up to 30 s, reset after success), relist.
        Cancel-safe: cancelling the task ends it cleanly and closes the API client."""
        api_client = await self._api_client_factory()
        try:
            api = client.DiscoveryV1Api(api_client)
            delay = self._backoff_seconds
            while True:
                try:
                    resource_version = await self._list(api)
                    delay = self._backoff_seconds
                    await self._watch(api, resource_version)
                    log.debug("endpointslices of %s: watch ended; relisting", self.ref)
                except _ApiStatusError as exc:
                    if exc.status == 410:
                        log.info("endpointslices of %s: watch expired (%s); relisting", self.ref, exc)
                    else:
                        log.warning("endpointslices of %s: %s; retrying in %.1fs", self.ref, exc, delay)
                # Anything else (connection refused or reset, bad JSON) is worth retrying too: a router that
                # stops discovering is worse than one that logs the same error every 30 s.
                except Exception as exc:
                    log.warning("endpointslices of %s: %r; retrying in %.1fs", self.ref, exc, delay)
                # Even after a watch that ended normally: a server that closes every watch at once must not
                # make us spin on relists.
                await self._sleep(delay)
                delay = min(delay * 2, MAX_BACKOFF_SECONDS)
        finally:
            await api_client.close()

    def _selector(self) -> str:
        return f"{SERVICE_NAME_LABEL}={self.ref.name}"

    def _owns(self, endpoint_slice: Mapping) -> bool:
        # The API server already filters by label; checking again costs nothing and keeps a server or proxy
        # that ignores labelSelector (kmock's emulator does) from leaking another Service's endpoints.
        labels = endpoint_slice.get("metadata", {}).get("labels") or {}
        return labels.get(SERVICE_NAME_LABEL) == self.ref.name

    async def _list(self, api: client.DiscoveryV1Api) -> str:
        response = await api.list_namespaced_endpoint_slice(
            self.ref.namespace,
            label_selector=self._selector(),
            _preload_content=False,
            _request_timeout=LIST_TIMEOUT_SECONDS,
        )
        async with response:
            body = await _json_body(response)
        self._slices = {s["metadata"]["name"]: s for s in body.get("items") or () if self._owns(s)}
        self._report()
        return (body.get("metadata") or {}).get("resourceVersion") or ""

    async def _watch(self, api: client.DiscoveryV1Api, resource_version: str) -> None:
        # The server ends the watch after timeoutSeconds; the client-side deadline (a little later) also covers
        # servers that ignore it and connections that hang or died without a FIN.
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(self._resync_seconds + 5.0):
                response = await api.list_namespaced_endpoint_slice(
                    self.ref.namespace,
                    label_selector=self._selector(),
                    watch="true",  # Python's True would go out as "True": the API server takes it, kmock does not
                    resource_version=resource_version,
                    timeout_seconds=max(1, round(self._resync_seconds)),
                    _preload_content=False,
                )
                try:
                    if response.status != 200:
                        await _json_body(response)  # raises with the server's Status message
                    async for line in response.content:
                        if line.strip():
                            self._apply(json.loads(line))
                finally:
                    response.close()  # not release(): an unfinished stream must not go back to the connection pool

    def _apply(self, event: Mapping) -> None:
        kind = event.get("type")
        obj = event.get("object") or {}
        if kind == "ERROR":
            raise _ApiStatusError(obj.get("code") or 500, obj.get("message") or "watch error")
        if kind not in ("ADDED", "MODIFIED", "DELETED"):
            return  # BOOKMARK: we never resume a watch (we relist), so its resourceVersion is of no use
        name = obj["metadata"]["name"]
        # A slice relabelled away from our Service is gone for us, whatever the event type.
        if kind == "DELETED" or not self._owns(obj):
            self._slices.pop(name, None)
        else:
            self._slices[name] = obj
        self._report()

    def _report(self) -> None:
        urls = ready_endpoint_urls(self._slices.values(), self.ref.port, self.ref.scheme)
        if urls == self._urls:
            return
        previous = self._urls or set()
        self._urls = urls
        log.info(
            "%s: %d ready endpoint(s); added %s, removed %s",
            self.ref,
            len(urls),
            sorted(urls - previous) or "none",
            sorted(previous - urls) or "none",
        )
        try:
            self._on_change(set(urls))
        except Exception:
            log.exception("%s: on_change callback failed", self.ref)


class EndpointsFileWatcher:
    """Replicas listed in a JSON file (a list of URLs), re-read when it changes: local
    discovery for `pagefleet up`, which rewrites the file (atomically) as it scales."""

    def __init__(self, path: str, on_change: Callable[[set[str]], None], interval: float = 0.5) -> None:
        self.path, self.on_change, self.interval = path, on_change, interval

    def read(self) -> set[str] | None:
        try:
            with open(self.path) as f:
                urls = json.load(f)
        except FileNotFoundError:
            return set()
        except (OSError, ValueError) as e:
            log.warning("endpoints file %s unreadable (%s); keeping the last list", self.path, e)
            return None
        if not isinstance(urls, list) or not all(isinstance(u, str) for u in urls):
            log.warning("endpoints file %s is not a JSON list of URLs; keeping the last list", self.path)
            return None
        return set(urls)

    async def run(self) -> None:
        last: set[str] | None = None
        while True:
            urls = self.read()
            if urls is not None and urls != last:
                self.on_change(urls)
                last = urls
            await asyncio.sleep(self.interval)
