"""EndpointSlice discovery: the pure URL extraction, ServiceRef parsing, and the watcher end to end.

The watcher talks to kmock's Kubernetes emulator (an in-process aiohttp server that stores objects and
serves list and watch) through the real kubernetes_asyncio client, so the requests, the raw JSON and the
watch stream are the same as against a cluster.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable, Iterable
from typing import Any

import kmock
import pytest
from kubernetes_asyncio import client

from pagefleet.router.discovery import EndpointSliceWatcher, ServiceRef, ready_endpoint_urls

# --- ready_endpoint_urls -----------------------------------------------------------------------------------


def endpoint(*addresses: str, **conditions: Any) -> dict[str, Any]:
    return {"addresses": list(addresses), "conditions": conditions}


def eps(*endpoints: dict[str, Any], ports: list[dict[str, Any]] | None = None, name: str = "s") -> dict[str, Any]:
    return {
        "metadata": {"name": name, "labels": {"kubernetes.io/service-name": "engine"}},
        "addressType": "IPv4",
        "ports": [{"name": "http", "port": 8000, "protocol": "TCP"}] if ports is None else ports,
        "endpoints": list(endpoints),
    }


TWO_PORTS = [{"name": "metrics", "port": 9090, "protocol": "TCP"}, {"name": "http", "port": 8000, "protocol": "TCP"}]

URL_CASES = [
    # id, slices, port, scheme, expected
    ("ready", [eps(endpoint("10.0.0.1", ready=True))], "http", "http", {"http://10.0.0.1:8000"}),
    ("not-ready", [eps(endpoint("10.0.0.1", ready=False))], "http", "http", set()),
    ("ready-absent", [eps(endpoint("10.0.0.1"))], "http", "http", {"http://10.0.0.1:8000"}),
    ("ready-null", [eps(endpoint("10.0.0.1", ready=None))], "http", "http", {"http://10.0.0.1:8000"}),
    ("no-conditions", [eps({"addresses": ["10.0.0.1"]})], "http", "http", {"http://10.0.0.1:8000"}),
    ("terminating", [eps(endpoint("10.0.0.1", ready=False, serving=True, terminating=True))], "http", "http", set()),
    ("ready-but-terminating", [eps(endpoint("10.0.0.1", ready=True, terminating=True))], "http", "http", set()),
    ("mixed", [eps(endpoint("10.0.0.1", ready=True), endpoint("10.0.0.2", ready=False), endpoint("10.0.0.3"))],
     "http", "http", {"http://10.0.0.1:8000", "http://10.0.0.3:8000"}),
    ("named-port", [eps(endpoint("10.0.0.1"), ports=TWO_PORTS)], "metrics", "http", {"http://10.0.0.1:9090"}),
    ("named-port-missing", [eps(endpoint("10.0.0.1"), ports=TWO_PORTS)], "grpc", "http", set()),
    ("numbered-port", [eps(endpoint("10.0.0.1"), ports=TWO_PORTS)], 8001, "http", {"http://10.0.0.1:8001"}),
    ("default-port-is-first", [eps(endpoint("10.0.0.1"), ports=TWO_PORTS)], None, "http", {"http://10.0.0.1:9090"}),
    ("all-ports-slice", [eps(endpoint("10.0.0.1"), ports=[{"name": "", "port": None}])], None, "http", set()),
    ("ipv6", [eps(endpoint("fd00::1", "2001:db8::2"))], "http", "http",
     {"http://[fd00::1]:8000", "http://[2001:db8::2]:8000"}),
    ("several-addresses", [eps(endpoint("10.0.0.1", "10.0.0.2"))], "http", "http",
     {"http://10.0.0.1:8000", "http://10.0.0.2:8000"}),
    ("https", [eps(endpoint("10.0.0.1"))], "http", "https", {"https://10.0.0.1:8000"}),
    ("overlapping-slices", [eps(endpoint("10.0.0.1"), endpoint("10.0.0.2"), name="a"),
                            eps(endpoint("10.0.0.2"), endpoint("10.0.0.3"), name="b")], "http", "http",
     {"http://10.0.0.1:8000", "http://10.0.0.2:8000", "http://10.0.0.3:8000"}),
    ("per-slice-port", [eps(endpoint("10.0.0.1"), name="a"),
                        eps(endpoint("10.0.0.2"), ports=[{"name": "http", "port": 8080}], name="b")], "http", "http",
     {"http://10.0.0.1:8000", "http://10.0.0.2:8080"}),
    ("no-ports-default", [eps(endpoint("10.0.0.1"), ports=[])], None, "http", set()),
    ("no-ports-named", [{"endpoints": [endpoint("10.0.0.1")]}], "http", "http", set()),
    # A number needs no port from the slice: it is where the caller says the pods listen.
    ("no-ports-numbered", [eps(endpoint("10.0.0.1"), ports=[])], 8000, "http", {"http://10.0.0.1:8000"}),
    ("null-endpoints", [{"ports": [{"name": "http", "port": 8000}], "endpoints": None}], "http", "http", set()),
    ("no-slices", [], "http", "http", set()),
]


@pytest.mark.parametrize(("slices", "port", "scheme", "expected"), [c[1:] for c in URL_CASES],
                         ids=[c[0] for c in URL_CASES])
def test_ready_endpoint_urls(slices, port, scheme, expected):
    assert ready_endpoint_urls(slices, port, scheme) == expected


def test_ready_endpoint_urls_takes_any_iterable():
    assert ready_endpoint_urls(iter([eps(endpoint("10.0.0.1"))]), "http") == {"http://10.0.0.1:8000"}


# --- ServiceRef.parse --------------------------------------------------------------------------------------


@pytest.mark.parametrize(("text", "expected"), [
    ("serving/engine", ServiceRef("serving", "engine")),
    ("serving/engine:8000", ServiceRef("serving", "engine", 8000)),
    ("serving/engine:http", ServiceRef("serving", "engine", "http")),
    ("serving/engine:http-2", ServiceRef("serving", "engine", "http-2")),
    ("  ns-1/llama-0 ", ServiceRef("ns-1", "llama-0")),
])
def test_service_ref_parse(text, expected):
    assert ServiceRef.parse(text) == expected


@pytest.mark.parametrize(("text", "complaint"), [
    ("", "expected NAMESPACE/NAME"),
    ("engine", "expected NAMESPACE/NAME"),
    ("/engine", "expected NAMESPACE/NAME"),
    ("serving/", "expected NAMESPACE/NAME"),
    ("serving/engine:", "expected NAMESPACE/NAME"),
    ("serving/engine/x", "service name 'engine/x' is not a DNS label"),
    ("Serving/engine", "namespace 'Serving' is not a DNS label"),
    ("serving/-engine", "service name '-engine' is not a DNS label"),
    ("serving/" + "e" * 64, "is not a DNS label"),
    ("serving/engine:0", "port 0 is outside 1-65535"),
    ("serving/engine:65536", "port 65536 is outside 1-65535"),
    ("serving/engine:ht_tp", "port 'ht_tp' is neither a number nor a port name"),
    ("serving/engine:80:81", "port '80:81' is neither a number nor a port name"),
])
def test_service_ref_parse_rejects(text, complaint):
    with pytest.raises(ValueError, match="invalid service reference") as info:
        ServiceRef.parse(text)
    assert complaint in str(info.value)
    assert repr(text) in str(info.value)


def test_service_ref_defaults():
    ref = ServiceRef.parse("serving/engine:http")
    assert ref.scheme == "http"
    assert str(ref) == "serving/engine:http"


# --- EndpointSliceWatcher against kmock ---------------------------------------------------------------------

NS = "serving"
SLICES = f"/apis/discovery.k8s.io/v1/namespaces/{NS}/endpointslices"
RESOURCE = kmock.resource("discovery.k8s.io/v1/endpointslices")
A, B, C = "http://10.0.0.1:8000", "http://10.0.0.2:8000", "http://10.0.0.3:8000"


def slice_object(name: str, service: str, endpoints: Iterable[dict[str, Any]], namespace: str = NS) -> dict:
    return {
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "metadata": {"name": name, "namespace": namespace, "labels": {"kubernetes.io/service-name": service}},
        "addressType": "IPv4",
        "ports": TWO_PORTS,
        "endpoints": list(endpoints),
    }


async def until(predicate: Callable[[], object], what: str, timeout: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not predicate():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        await asyncio.sleep(0.01)


async def send(request: Any) -> dict[str, Any]:
    response = await request
    assert response.status == 200, await response.text()
    return await response.json()


@contextlib.asynccontextmanager
async def fake_cluster() -> AsyncIterator[tuple[kmock.KubernetesEmulator, Callable[[], Any], list]]:
    """kmock's emulator on a free local port, and an ApiClient factory pointing at it (clients are kept to
    check that the watcher closes them)."""
    async with kmock.KubernetesEmulator() as k8s, kmock.Server(k8s) as server:
        # Declared, so that listing the still-empty collection answers 200 with no items, not 404.
        k8s.resources[RESOURCE] = {}
        api_clients: list[client.ApiClient] = []

        async def api_client_factory() -> client.ApiClient:
            api_clients.append(client.ApiClient(client.Configuration(host=str(server.url).rstrip("/"))))
            return api_clients[-1]

        yield k8s, api_client_factory, api_clients


@contextlib.asynccontextmanager
async def running(watcher: EndpointSliceWatcher) -> AsyncIterator[asyncio.Task]:
    """The watcher as a task, cancelled on the way out even when the test fails (its open watch would otherwise
    hold kmock's server open, and the failure would surface as a timeout instead of the assertion)."""
    task = asyncio.create_task(watcher.run())
    try:
        yield task
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.wait_for(task, 5)


def test_watcher_follows_endpoint_slices():
    async def scenario() -> None:
        async with fake_cluster() as (k8s, api_client_factory, api_clients):
            changes: list[set[str]] = []
            watcher = EndpointSliceWatcher(ServiceRef(NS, "engine", "http"), changes.append,
                                           api_client_factory=api_client_factory, backoff_seconds=0.01)
            async with running(watcher) as task:
                await until(lambda: changes == [set()], "the report after the initial (empty) list")
                await until(lambda: len(k8s[kmock.action.WATCH]) == 1, "the watch request")

                # Another Service's slice, and our Service's name in another namespace: neither may show up.
                await send(k8s.post(SLICES, json=slice_object("other-x1", "other", [endpoint("10.9.0.1")])))
                await send(k8s.post("/apis/discovery.k8s.io/v1/namespaces/elsewhere/endpointslices",
                                    json=slice_object("engine-e1", "engine", [endpoint("10.8.0.1")], "elsewhere")))
                await send(k8s.post(SLICES, json=slice_object("engine-a1", "engine", [
                    endpoint("10.0.0.1", ready=True), endpoint("10.0.0.2", ready=True)])))
                await until(lambda: changes[-1] == {A, B}, "two ready endpoints (ADDED)")

                await send(k8s.patch(f"{SLICES}/engine-a1", json={"endpoints": [
                    endpoint("10.0.0.1", ready=True), endpoint("10.0.0.2", ready=True), endpoint("10.0.0.3")]}))
                await until(lambda: changes[-1] == {A, B, C}, "a third endpoint (MODIFIED)")

                await send(k8s.patch(f"{SLICES}/engine-a1", json={"endpoints": [
                    endpoint("10.0.0.1", ready=True), endpoint("10.0.0.2", ready=False), endpoint("10.0.0.3")]}))
                await until(lambda: changes[-1] == {A, C}, "one endpoint not ready (MODIFIED)")

                await send(k8s.delete(f"{SLICES}/engine-a1"))
                await until(lambda: changes[-1] == set(), "no endpoints after the slice is gone (DELETED)")

            # Exactly one report per change: nothing spurious from the other slices or the unchanged lists.
            assert changes == [set(), {A, B}, {A, B, C}, {A, C}, set()]

            # One list, then one watch from its resourceVersion, both asking the server for our Service only.
            (listing,) = k8s[kmock.action.LIST][RESOURCE]
            (watching,) = k8s[kmock.action.WATCH][RESOURCE]
            for request in (listing, watching):
                assert request.namespace == NS
                assert request.params["labelSelector"] == "kubernetes.io/service-name=engine"
            assert watching.params["resourceVersion"] == "..."  # what kmock's list answered

            # Cancelled cleanly, and the API client (its aiohttp session) closed.
            assert task.cancelled()
            assert api_clients[0].rest_client.pool_manager.closed

    asyncio.run(asyncio.wait_for(scenario(), 15))


def test_watcher_backs_off_and_relists_after_errors_and_410():
    async def scenario() -> None:
        async with fake_cluster() as (k8s, api_client_factory, api_clients):
            # The API server is down for three lists, then the first watch has expired (410 Gone, sent as a
            # watch ERROR event as the real API server does), and after that kmock serves normally.
            k8s[kmock.action.LIST][:3] << 503 << {"kind": "Status", "code": 503, "message": "etcd is sulking"}
            k8s[kmock.action.WATCH][:1] << ({"type": "ERROR", "object": {
                "kind": "Status", "code": 410, "reason": "Expired", "message": "too old resource version: 1 (42)"}},)
            changes: list[set[str]] = []
            watcher = EndpointSliceWatcher(ServiceRef(NS, "engine", "http"), changes.append,
                                           api_client_factory=api_client_factory, backoff_seconds=10.0)
            sleeps: list[float] = []

            async def record_sleep(seconds: float) -> None:
                sleeps.append(seconds)
                await asyncio.sleep(0)

            watcher._sleep = record_sleep
            async with running(watcher) as task:
                # The collection stays empty until the second watch is open: kmock's emulator can miss an event
                # that lands while it replays the existing objects to a new watch.
                await until(lambda: len(k8s[kmock.action.WATCH]) == 2, "a second watch after the 410")
                await send(k8s.post(SLICES, json=slice_object("engine-a1", "engine", [endpoint("10.0.0.1")])))
                await until(lambda: changes and changes[-1] == {A}, "the new slice through the second watch")

            # Doubling from backoff_seconds, capped at 30 s, and back to the start after the list succeeded.
            assert sleeps == [10.0, 20.0, 30.0, 10.0]
            assert len(k8s[kmock.action.LIST]) == 5  # 3 failed, 1 before the 410, 1 after it
            assert changes == [set(), {A}]  # the relist after the 410 changed nothing, so no report
            assert task.cancelled()
            assert len(api_clients) == 1 and api_clients[0].rest_client.pool_manager.closed

    asyncio.run(asyncio.wait_for(scenario(), 15))


def test_watcher_survives_a_failing_callback():
    async def scenario() -> None:
        async with fake_cluster() as (k8s, api_client_factory, _):
            seen: list[set[str]] = []

            def on_change(urls: set[str]) -> None:
                seen.append(urls)
                raise RuntimeError("router bug")

            # No port in the ref: the slice's first port (metrics, 9090).
            watcher = EndpointSliceWatcher(ServiceRef(NS, "engine"), on_change, api_client_factory=api_client_factory)
            async with running(watcher) as task:
                await until(lambda: seen == [set()], "the first report")
                await until(lambda: len(k8s[kmock.action.WATCH]) == 1, "the watch request")
                await send(k8s.post(SLICES, json=slice_object("engine-a1", "engine", [endpoint("10.0.0.1")])))
                await until(lambda: seen[-1] == {"http://10.0.0.1:9090"}, "the next report despite the failure")
                assert not task.done()

    asyncio.run(asyncio.wait_for(scenario(), 15))


def test_default_api_client_uses_kubeconfig_outside_a_cluster(tmp_path, monkeypatch):
    from kubernetes_asyncio.config import kube_config

    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)  # not in a pod: in-cluster config must fail

    async def scenario() -> None:
        async with kmock.KubernetesEmulator() as k8s, kmock.Server(k8s) as server:
            k8s.resources[RESOURCE] = {}
            kubeconfig = tmp_path / "kubeconfig"
            kubeconfig.write_text(
                "apiVersion: v1\nkind: Config\ncurrent-context: fake\n"
                f"clusters: [{{name: fake, cluster: {{server: '{str(server.url).rstrip('/')}'}}}}]\n"
                "users: [{name: fake, user: {token: t0ken}}]\n"
                "contexts: [{name: fake, context: {cluster: fake, user: fake}}]\n"
            )
            monkeypatch.setattr(kube_config, "KUBE_CONFIG_DEFAULT_LOCATION", str(kubeconfig))
            changes: list[set[str]] = []
            async with running(EndpointSliceWatcher(ServiceRef(NS, "engine"), changes.append)):
                await until(lambda: changes == [set()], "the first report through the kubeconfig's server")
            assert k8s[kmock.action.LIST][0].headers["Authorization"] == "Bearer t0ken"

    asyncio.run(asyncio.wait_for(scenario(), 15))


# --- discovery drives routing ------------------------------------------------------------------------------


def test_discovered_replicas_are_routed_to_and_removed_ones_are_not():
    """EndpointSlices in kmock -> watcher -> router pool -> requests through the router's HTTP app:
    a replica whose endpoint appears starts receiving requests, one whose slice is deleted stops."""
    import httpx
    from helpers import LiveServer, scripted_upstream

    from pagefleet.router.app import REPLICA_HEADER, Router, RouterSettings, build_app
    from pagefleet.router.policy import Policy
    from pagefleet.router.pool import Pool

    ups = [LiveServer(scripted_upstream([f"data: {i}\n\n".encode()], 0)).start(ready=False) for i in range(2)]

    def engine_slice(name: str, port: int) -> dict:
        obj = slice_object(name, "engine", [endpoint("127.0.0.1", ready=True)])
        obj["ports"] = [{"name": "http", "port": port, "protocol": "TCP"}]
        return obj

    async def scenario() -> None:
        async with fake_cluster() as (k8s, api_client_factory, _):
            pool = Pool("main", "m", policy=Policy.ROUND_ROBIN)
            router = Router([pool], RouterSettings(scrape_interval=0.05))
            watcher = EndpointSliceWatcher(ServiceRef(NS, "engine", "http"), lambda urls: router.set_urls(pool, urls),
                                           api_client_factory=api_client_factory, backoff_seconds=0.01)
            app = build_app(router, [watcher.run])
            async with app.api.router.lifespan_context(app.api), httpx.AsyncClient(
                    transport=httpx.ASGITransport(app=app), base_url="http://router") as http:

                async def served_by(n: int) -> set[str]:
                    seen = set()
                    for _ in range(n):
                        r = await http.post("/v1/completions", json={"model": "m", "prompt": "x"})
                        if r.status_code == 200:
                            seen.add(r.headers[REPLICA_HEADER])
                    return seen

                async def health() -> int:
                    return (await http.get("/health")).status_code

                assert await health() == 503  # no endpoints yet
                await send(k8s.post(SLICES, json=engine_slice("engine-0", ups[0].port)))
                await until(lambda: len(pool.available(router.clock())) == 1, "the first replica to be ready")
                assert await served_by(4) == {ups[0].url}

                await send(k8s.post(SLICES, json=engine_slice("engine-1", ups[1].port)))
                await until(lambda: len(pool.available(router.clock())) == 2, "the second replica to be ready")
                assert await served_by(4) == {ups[0].url, ups[1].url}

                await send(k8s.delete(f"{SLICES}/engine-0"))
                await until(lambda: list(pool.replicas) == [ups[1].url], "the removed replica to leave the pool")
                assert await served_by(4) == {ups[1].url}
                assert await health() == 200

    try:
        asyncio.run(asyncio.wait_for(scenario(), 20))
    finally:
        for u in ups:
            u.stop()
