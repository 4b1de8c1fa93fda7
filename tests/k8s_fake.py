"""A protocol fake of the Kubernetes API server, over real HTTP on loopback, for discovery tests.

It is not Kubernetes: it holds pods and InferencePools of one namespace in memory and speaks just
the parts of the API protocol that kvgate's discovery uses, as a real API server does:
- GET /api/v1/namespaces/NS/pods?labelSelector=...: a PodList with metadata.resourceVersion;
- the same with watch=1: a chunked stream of JSON lines {"type": ADDED|MODIFIED|DELETED|BOOKMARK|ERROR,
  "object": ...}, replaying the events after ?resourceVersion=, then following new ones; a pod that
  starts or stops matching the selector arrives as ADDED or DELETED; bookmarks only with
  allowWatchBookmarks=true; the stream ends after timeoutSeconds; a resourceVersion older than the
  compacted history gets an ERROR event with a Status of code 410 (Gone);
- GET /apis/inference.networking.k8s.io/v1/namespaces/NS/inferencepools/NAME;
- Authorization: Bearer TOKEN checked on every request (401 otherwise).
Tests drive it (add, change, delete pods; compact history; go down and come back) and read what
clients asked (`requests`).
"""

from __future__ import annotations

import asyncio
import copy
from dataclasses import dataclass, field
from typing import Any

import orjson
from aiohttp import web

TOKEN = "fake-service-account-token"
NAMESPACE = "inference"


def _matches(selector: str, labels: dict[str, str]) -> bool:
    """Equality-based label selectors: k=v, k==v, k!=v, k (exists), !k (absent)."""
    for term in filter(None, (part.strip() for part in selector.split(","))):
        if "!=" in term:
            key, value = term.split("!=", 1)
            if labels.get(key.strip()) == value.strip():
                return False
        elif "=" in term:
            key, value = term.replace("==", "=").split("=", 1)
            if labels.get(key.strip()) != value.strip():
                return False
        elif term.startswith("!"):
            if term[1:] in labels:
                return False
        elif term not in labels:
            return False
    return True


def _status(code: int, reason: str, message: str) -> dict:
    return {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure", "message": message,
            "reason": reason, "code": code}


@dataclass
class _Change:
    version: int
    before: dict | None
    after: dict | None


@dataclass
class _Watcher:
    selector: str
    bookmarks: bool
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    request: web.Request | None = None


class FakeKubeAPI:
    def __init__(self, namespace: str = NAMESPACE) -> None:
        self.namespace = namespace
        self.version = 1000
        self.pods: dict[str, dict] = {}
        self.pools: dict[str, dict] = {}
        self.history: list[_Change] = []
        self.compacted_below = 0  # watches from an older resourceVersion get 410 Gone
        self.requests: list[tuple[str, dict[str, str]]] = []
        self.url = ""
        self._watchers: list[_Watcher] = []
        self._runner: web.AppRunner | None = None
        self._site: web.TCPSite | None = None
        self._port = 0

    # --- serving ---

    async def start(self) -> FakeKubeAPI:
        app = web.Application()
        app.router.add_get(f"/api/v1/namespaces/{self.namespace}/pods", self._pods_route)
        app.router.add_get("/apis/inference.networking.k8s.io/v1/namespaces/{ns}/inferencepools/{name}",
                           self._pool_route)
        self._runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
        await self._runner.setup()
        await self.come_back()
        self.url = f"http://127.0.0.1:{self._port}"
        return self

    async def go_down(self) -> None:
        """Stop listening and cut every open watch, as an API server that crashed."""
        assert self._site is not None
        await self._site.stop()
        self._site = None
        for watcher in list(self._watchers):
            if watcher.request is not None and watcher.request.transport is not None:
                watcher.request.transport.abort()

    async def come_back(self) -> None:
        assert self._runner is not None
        self._site = web.TCPSite(self._runner, "127.0.0.1", self._port)
        await self._site.start()
        self._port = self._runner.addresses[-1][1]

    async def close(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    def kubeconfig(self) -> str:
        """A kubeconfig (YAML) whose current context points at this server."""
        return (f"apiVersion: v1\nkind: Config\ncurrent-context: fake\n"
                f"clusters: [{{name: fake, cluster: {{server: '{self.url}'}}}}]\n"
                f"users: [{{name: fake, user: {{token: {TOKEN}}}}}]\n"
                f"contexts: [{{name: fake, context: {{cluster: fake, user: fake, namespace: {self.namespace}}}}}]\n")

    # --- the cluster's state, as a test changes it ---

    def put_pod(self, name: str, ip: str, labels: dict[str, str] | None = None,
                annotations: dict[str, str] | None = None, ready: bool = True, deliver: bool = True) -> dict:
        """Create or replace a pod (a new resourceVersion). `deliver=False`: watchers miss the change
        (as if it happened while they were away), only a relist sees it."""
        before = self.pods.get(name)
        self.version += 1
        pod = {
            "kind": "Pod", "apiVersion": "v1",
            "metadata": {"name": name, "namespace": self.namespace, "uid": f"uid-{name}",
                         "resourceVersion": str(self.version), "labels": dict(labels or {}),
                         "annotations": dict(annotations or {})},
            "spec": {"containers": [{"name": "engine", "image": "vllm"}]},
            "status": {"phase": "Running", "podIP": ip,
                       "conditions": [{"type": "Ready", "status": "True" if ready else "False"}]},
        }
        self.pods[name] = pod
        self._record(before, pod, deliver)
        return pod

    def change_pod(self, name: str, *, ready: bool | None = None, labels: dict[str, str] | None = None,
                   annotations: dict[str, str] | None = None, terminating: bool = False) -> None:
        pod = copy.deepcopy(self.pods[name])
        meta = pod["metadata"]
        if ready is not None:
            pod["status"]["conditions"] = [{"type": "Ready", "status": "True" if ready else "False"}]
        if labels is not None:
            meta["labels"] = dict(labels)
        if annotations is not None:
            meta["annotations"] = dict(annotations)
        if terminating:
            meta["deletionTimestamp"] = "2030-01-01T00:00:00Z"
        before = self.pods[name]
        self.version += 1
        meta["resourceVersion"] = str(self.version)
        self.pods[name] = pod
        self._record(before, pod, True)

    def delete_pod(self, name: str, deliver: bool = True) -> None:
        before = self.pods.pop(name)
        self.version += 1
        self._record(before, None, deliver)

    def put_pool(self, name: str, match_labels: dict[str, str], ports: list[int]) -> None:
        self.version += 1
        self.pools[name] = {
            "apiVersion": "inference.networking.k8s.io/v1", "kind": "InferencePool",
            "metadata": {"name": name, "namespace": self.namespace, "resourceVersion": str(self.version)},
            "spec": {"selector": {"matchLabels": dict(match_labels)},
                     "targetPorts": [{"number": port} for port in ports],
                     "endpointPickerRef": {"name": "kvgate", "port": {"number": 9002}}},
        }

    def compact(self) -> None:
        """Forget the history so far and end the open watches: their resumption gets 410 Gone."""
        self.compacted_below = self.version + 1
        self.history.clear()
        for watcher in list(self._watchers):
            watcher.queue.put_nowait(None)

    def bookmark(self) -> None:
        for watcher in self._watchers:
            if watcher.bookmarks:
                watcher.queue.put_nowait({"type": "BOOKMARK", "object": self._bookmark_object()})

    def watches_open(self) -> int:
        return len(self._watchers)

    def _record(self, before: dict | None, after: dict | None, deliver: bool) -> None:
        change = _Change(self.version, copy.deepcopy(before), copy.deepcopy(after))
        self.history.append(change)
        if deliver:
            for watcher in self._watchers:
                event = self._event_for(change, watcher.selector)
                if event is not None:
                    watcher.queue.put_nowait(event)

    def _event_for(self, change: _Change, selector: str) -> dict | None:
        was = change.before is not None and _matches(selector, change.before["metadata"]["labels"])
        now = change.after is not None and _matches(selector, change.after["metadata"]["labels"])
        if now:
            return {"type": "MODIFIED" if was else "ADDED", "object": change.after}
        if was:
            gone = copy.deepcopy(change.before)
            gone["metadata"]["resourceVersion"] = str(change.version)
            return {"type": "DELETED", "object": gone}
        return None

    def _bookmark_object(self) -> dict:
        return {"kind": "Pod", "apiVersion": "v1", "metadata": {"resourceVersion": str(self.version)}}

    # --- routes ---

    def _authorized(self, request: web.Request) -> bool:
        self.requests.append((request.path, dict(request.query)))
        return request.headers.get("Authorization") == f"Bearer {TOKEN}"

    async def _pool_route(self, request: web.Request) -> web.Response:
        if not self._authorized(request):
            return web.json_response(_status(401, "Unauthorized", "Unauthorized"), status=401)
        pool = self.pools.get(request.match_info["name"])
        if request.match_info["ns"] != self.namespace or pool is None:
            message = f'inferencepools.inference.networking.k8s.io "{request.match_info["name"]}" not found'
            return web.json_response(_status(404, "NotFound", message), status=404)
        return web.json_response(pool)

    async def _pods_route(self, request: web.Request) -> web.StreamResponse:
        if not self._authorized(request):
            return web.json_response(_status(401, "Unauthorized", "Unauthorized"), status=401)
        selector = request.query.get("labelSelector", "")
        if request.query.get("watch") not in ("1", "true", "True"):
            items = [pod for pod in self.pods.values() if _matches(selector, pod["metadata"]["labels"])]
            return web.json_response({"kind": "PodList", "apiVersion": "v1",
                                      "metadata": {"resourceVersion": str(self.version)}, "items": items})
        return await self._watch(request, selector)

    async def _watch(self, request: web.Request, selector: str) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "application/json"})
        response.enable_chunked_encoding()
        await response.prepare(request)
        since = int(request.query.get("resourceVersion") or self.version)
        if since < self.compacted_below - 1:
            gone = _status(410, "Expired", f"too old resource version: {since} ({self.compacted_below - 1})")
            await response.write(orjson.dumps({"type": "ERROR", "object": gone}) + b"\n")
            return response
        watcher = _Watcher(selector, request.query.get("allowWatchBookmarks") in ("true", "1", "True"),
                           request=request)
        for change in self.history:
            if change.version > since:
                event = self._event_for(change, selector)
                if event is not None:
                    watcher.queue.put_nowait(event)
        self._watchers.append(watcher)
        deadline = asyncio.get_running_loop().time() + float(request.query.get("timeoutSeconds", 1800))
        try:
            while True:
                left = deadline - asyncio.get_running_loop().time()
                try:
                    event: dict[str, Any] | None = await asyncio.wait_for(watcher.queue.get(), max(left, 0))
                except TimeoutError:
                    if watcher.bookmarks:  # as an API server does when a watch times out
                        await response.write(orjson.dumps({"type": "BOOKMARK", "object": self._bookmark_object()})
                                             + b"\n")
                    break
                if event is None:
                    break
                await response.write(orjson.dumps(event) + b"\n")
        finally:
            self._watchers.remove(watcher)
        await response.write_eof()
        return response
