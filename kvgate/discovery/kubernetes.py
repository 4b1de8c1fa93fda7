"""--discovery kubernetes: the fleet is the ready pods of a label selector or of an InferencePool.

The Kubernetes way to follow a set of objects: list them (which gives a resourceVersion), then
watch from that version with bookmarks on, each watch ending after --discovery-watch-timeout-s and
resumed from the last version seen. Between two watches the InferencePool (if one is named) is read
again; a changed selector or port list means a relist. A watch whose version the API server no
longer holds ends with an ERROR event 410 Gone: the pods are listed again. Any other failure (API
server down, refused, timed out) is retried with an exponential backoff, and meanwhile the fleet is
left exactly as it was: an unreachable API server never stops routing to the last known fleet.

The client is kubernetes_asyncio, configured from --discovery-kubeconfig, else the in-cluster
service account, else the default kubeconfig ($KUBECONFIG or ~/.kube/config). RBAC needed: get,
list, watch on pods, and get on inferencepools (docs/DISCOVERY.md).
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Callable, Mapping
from pathlib import Path

import aiohttp
import orjson
from kubernetes_asyncio import client, config, watch
from kubernetes_asyncio.client.exceptions import ApiException
from kubernetes_asyncio.config.config_exception import ConfigException

from kvgate.config.settings import InstanceConfig, Settings
from kvgate.discovery.pods import Pod, PodError, pod_instances, pod_name, pool_target
from kvgate.metrics.definitions import DiscoveryMetrics

log = logging.getLogger(__name__)

SOURCE = "kubernetes"
POOL_GROUP = "inference.networking.k8s.io"
POOL_VERSION = "v1"
POOL_PLURAL = "inferencepools"
_SERVICE_ACCOUNT_NAMESPACE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")
_BACKOFF_FIRST_S = 0.5
# Client-side bound on a list or a GET, and on a silent watch beyond its server-side timeout.
_REQUEST_TIMEOUT_S = 30.0
_FAILURES = (ApiException, ConfigException, aiohttp.ClientError, asyncio.TimeoutError, ValueError, OSError)

Target = tuple[str, tuple[int, ...] | None]  # label selector, InferencePool target ports (None: no pool)


class _Expired(Exception):
    """The watch's resourceVersion is gone from the API server (410): list again."""


class _PoolChanged(Exception):
    """The InferencePool now selects other pods or ports: list again."""


async def api_client(settings: Settings) -> client.ApiClient:
    """An API client from --discovery-kubeconfig, the in-cluster service account or the default kubeconfig."""
    context = settings.discovery_kube_context or None
    if settings.discovery_kubeconfig:
        return await config.new_client_from_config(config_file=settings.discovery_kubeconfig, context=context)
    try:
        configuration = client.Configuration()
        config.load_incluster_config(client_configuration=configuration)
        return client.ApiClient(configuration)
    except ConfigException:
        return await config.new_client_from_config(context=context)


def namespace(settings: Settings) -> str:
    if settings.discovery_namespace:
        return settings.discovery_namespace
    try:
        return _SERVICE_ACCOUNT_NAMESPACE.read_text().strip() or "default"
    except OSError:
        return "default"


class KubernetesSource:
    def __init__(self, settings: Settings, metrics: DiscoveryMetrics,
                 apply: Callable[[Mapping[str, InstanceConfig]], None]) -> None:
        self._settings = settings
        self._metrics = metrics
        self._apply = apply
        self._namespace = namespace(settings)
        self._pods: dict[str, list[InstanceConfig]] = {}  # ready pods' instances by pod name
        self._backoff_s = _BACKOFF_FIRST_S  # the next wait after a failure; reset by a successful list

    async def run(self) -> None:
        api: client.ApiClient | None = None
        reason = "start"
        try:
            while True:
                try:
                    if api is None:  # a missing kubeconfig is retried too: it may be mounted late
                        api = await api_client(self._settings)
                    await self._list_and_watch(api, reason)
                except _Expired:
                    reason = "expired"
                    log.info("discovery (kubernetes): the watch's resourceVersion expired (410 Gone); listing again")
                except _PoolChanged:
                    reason = "pool_changed"
                    log.info("discovery (kubernetes): InferencePool %s changed; listing again",
                             self._settings.discovery_inference_pool)
                except Exception as exc:  # noqa: BLE001 - whatever fails, the last known fleet keeps routing
                    reason = "error"
                    self._metrics.errors.labels(SOURCE, "api" if api is not None else "config").inc()
                    self._metrics.source_up.labels(SOURCE).set(0)
                    wait_s = self._backoff_s * random.uniform(0.5, 1.0)
                    log.warning("discovery (kubernetes): %s; keeping the last known fleet, retrying in %.1fs",
                                _describe(exc), wait_s, exc_info=not isinstance(exc, _FAILURES))
                    await asyncio.sleep(wait_s)
                    self._backoff_s = min(self._backoff_s * 2, self._settings.discovery_backoff_max_s)
        finally:
            if api is not None:
                await api.close()

    async def _list_and_watch(self, api: client.ApiClient, reason: str) -> None:
        target = await self._target(api)
        version = await self._list(api, target, reason)
        self._metrics.source_up.labels(SOURCE).set(1)
        self._backoff_s = _BACKOFF_FIRST_S
        while True:
            version = await self._watch(api, target, version)
            if await self._target(api) != target:
                raise _PoolChanged

    async def _target(self, api: client.ApiClient) -> Target:
        name = self._settings.discovery_inference_pool
        if not name:
            return self._settings.discovery_label_selector, None
        pool = await client.CustomObjectsApi(api).get_namespaced_custom_object(
            POOL_GROUP, POOL_VERSION, self._namespace, POOL_PLURAL, name, _request_timeout=_REQUEST_TIMEOUT_S)
        return pool_target(pool)

    async def _list(self, api: client.ApiClient, target: Target, reason: str) -> str:
        """Replace the known pods by a full list; returns the list's resourceVersion."""
        response = await client.CoreV1Api(api).list_namespaced_pod(
            self._namespace, label_selector=target[0], _preload_content=False, _request_timeout=_REQUEST_TIMEOUT_S)
        async with response:
            body = await response.read()
            if response.status != 200:
                raise ApiException(status=response.status, reason=response.reason)
        listing = orjson.loads(body)
        self._metrics.relists.labels(reason).inc()
        self._pods = {}
        for pod in listing.get("items") or ():
            self._pods[pod_name(pod)] = self._instances(pod, target)
        self._publish()
        return str(listing["metadata"]["resourceVersion"])

    async def _watch(self, api: client.ApiClient, target: Target, version: str) -> str:
        """Follow pod events from `version` until the server ends the watch; returns the last version seen."""
        timeout_s = self._settings.discovery_watch_timeout_s
        async with watch.Watch() as watcher:
            stream = watcher.stream(
                client.CoreV1Api(api).list_namespaced_pod, self._namespace, label_selector=target[0],
                resource_version=version, allow_watch_bookmarks=True, timeout_seconds=timeout_s,
                _request_timeout=aiohttp.ClientTimeout(connect=_REQUEST_TIMEOUT_S,
                                                       sock_read=timeout_s + _REQUEST_TIMEOUT_S))
            try:
                async for event in stream:
                    if not isinstance(event, dict):  # a line that is not JSON: not an API server's answer
                        raise ValueError(f"unexpected line in the pod watch: {str(event)[:200]!r}")
                    version = self._on_event(event["type"], event["raw_object"], target) or version
            except ApiException as exc:
                if exc.status == 410:
                    raise _Expired from None
                raise
        return version

    def _on_event(self, kind: str, pod: Pod, target: Target) -> str | None:
        """Apply one watch event; returns the resourceVersion it carries."""
        self._metrics.events.labels(SOURCE, kind).inc()
        if kind in ("ADDED", "MODIFIED"):
            instances = self._instances(pod, target)
            if self._pods.get(pod_name(pod)) != instances:
                self._pods[pod_name(pod)] = instances
                self._publish()
        elif kind == "DELETED" and self._pods.pop(pod_name(pod), None):
            self._publish()
        return (pod.get("metadata") or {}).get("resourceVersion")

    def _instances(self, pod: Pod, target: Target) -> list[InstanceConfig]:
        try:
            return pod_instances(pod, target[1], self._settings.discovery_port, self._settings.discovery_model)
        except PodError as exc:
            self._metrics.errors.labels(SOURCE, "pod_invalid").inc()
            log.error("discovery (kubernetes): %s; the pod is left out", exc)
            return []

    def _publish(self) -> None:
        self._apply({instance.id: instance for instances in self._pods.values() for instance in instances})


def _describe(exc: BaseException) -> str:
    if isinstance(exc, ConfigException | FileNotFoundError):
        return f"no usable Kubernetes credentials ({exc})"
    if isinstance(exc, ApiException):
        return f"the API server answered {exc.status} {exc.reason}"
    if isinstance(exc, asyncio.TimeoutError):
        return "the API server did not answer in time"
    if isinstance(exc, _FAILURES):
        return f"the API server cannot be reached or answered wrongly ({type(exc).__name__}: {exc})"
    return f"pod discovery failed unexpectedly ({type(exc).__name__}: {exc})"
