"""A stub Kubernetes API server on loopback: EndpointSlices, list and watch, for the real
`kubernetes` client (no kube-apiserver can be installed here).

What it serves, as the API server does:
- `GET /apis/discovery.k8s.io/v1/namespaces/{ns}/endpointslices?labelSelector=...` — the list,
  with the collection's `metadata.resourceVersion`;
- the same with `watch=true&resourceVersion=N` — a chunked stream of JSON lines: the events after
  N from its history, then live ones, until `timeoutSeconds` (ending with a BOOKMARK when asked
  for bookmarks); a version older than the compacted history gets one `ERROR` event carrying a
  410 `Status` ("too old resource version") and the end of the stream.
- Every request must carry the kubeconfig's bearer token (else 401), so the tests show the
  client really used the kubeconfig they wrote.

The test thread changes the state with `put`, `delete` and `expire`; the server's event loop
delivers the events to open watches.
"""

from __future__ import annotations

import asyncio
import copy
import threading
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

TOKEN = "stub-token"
SLICES_PATH = "/apis/discovery.k8s.io/v1/namespaces/{namespace}/endpointslices"
POD_PATH = "/api/v1/namespaces/{namespace}/pods/{name}"


def endpoint_slice(
    name: str,
    service: str,
    endpoints: list[dict[str, Any]],
    *,
    port: int,
    port_name: str = "http",
    address_type: str = "IPv4",
) -> dict[str, Any]:
    """An EndpointSlice as the EndpointSlice controller writes it."""
    return {
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "metadata": {"name": name, "labels": {"kubernetes.io/service-name": service}},
        "addressType": address_type,
        "endpoints": endpoints,
        "ports": [{"name": port_name, "port": port, "protocol": "TCP"}],
    }


def pod_endpoint(address: str, pod: str, uid: str, *, ready: bool = True) -> dict[str, Any]:
    return {
        "addresses": [address],
        "conditions": {"ready": ready, "serving": ready, "terminating": False},
        "targetRef": {"kind": "Pod", "name": pod, "namespace": "engines", "uid": uid},
    }


def pod(name: str, uid: str, annotations: dict[str, str]) -> dict[str, Any]:
    """A Pod as `GET .../pods/{name}` returns it (only what discovery reads)."""
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": name,
            "namespace": "engines",
            "uid": uid,
            "annotations": annotations,
        },
    }


def _matches(labels: dict[str, str], selector: str) -> bool:
    """Equality-based selectors (`a=b,c==d,e!=f`): what discovery uses."""
    for term in filter(None, (t.strip() for t in selector.split(","))):
        if "!=" in term:
            key, value = term.split("!=", 1)
            if labels.get(key.strip()) == value.strip():
                return False
        else:
            key, value = term.replace("==", "=").split("=", 1)
            if labels.get(key.strip()) != value.strip():
                return False
    return True


@dataclass
class _Watch:
    queue: asyncio.Queue[dict[str, Any] | None]
    selector: str


@dataclass
class KubeStub:
    namespace: str = "engines"
    version: int = 1000
    slices: dict[str, dict[str, Any]] = field(default_factory=dict)
    history: list[tuple[int, str, dict[str, Any]]] = field(default_factory=list)
    compacted_through: int = 0
    """Events at or before this version are gone: a watch from an older version gets a 410."""
    requests: list[tuple[str, dict[str, str]]] = field(default_factory=list)
    """(kind, query) of every request served: "list", "watch", "gone" or "pod"."""
    pods: dict[str, dict[str, Any]] = field(default_factory=dict)
    """pod name -> the Pod (`GET .../pods/{name}`; a name not here is a 404)."""
    loop: asyncio.AbstractEventLoop | None = None
    _watches: list[_Watch] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    # -- the test's side (any thread) -------------------------------------------------------
    def put(self, slice_: dict[str, Any]) -> None:
        """Create or replace a slice: ADDED or MODIFIED to every matching watch."""
        with self._lock:
            kind = "MODIFIED" if slice_["metadata"]["name"] in self.slices else "ADDED"
            self._record(kind, slice_)

    def delete(self, name: str) -> None:
        with self._lock:
            self._record("DELETED", self.slices[name])

    def expire(self, change: Callable[[dict[str, dict[str, Any]]], None] | None = None) -> None:
        """Compact the history and drop every open watch, as an API server does after etcd
        compaction; `change` edits the slices meanwhile without any event (only a new list can
        see it). The watchers' next watch is from a version now too old: 410."""
        with self._lock:
            if change is not None:
                change(self.slices)
                self.version += 1
                for item in self.slices.values():
                    item["metadata"]["resourceVersion"] = str(self.version)
            self.compacted_through = self.version
            self.history.clear()
            self._broadcast(None)

    def count(self, kind: str) -> int:
        return sum(1 for k, _ in self.requests if k == kind)

    def _record(self, kind: str, slice_: dict[str, Any]) -> None:
        self.version += 1
        item = copy.deepcopy(slice_)
        item["metadata"]["resourceVersion"] = str(self.version)
        item["metadata"].setdefault("namespace", self.namespace)
        item["metadata"].setdefault("uid", f"uid-{item['metadata']['name']}")
        if kind == "DELETED":
            self.slices.pop(item["metadata"]["name"], None)
        else:
            self.slices[item["metadata"]["name"]] = item
        self.history.append((self.version, kind, item))
        self._broadcast({"type": kind, "object": item})

    def _broadcast(self, event: dict[str, Any] | None) -> None:
        loop = self.loop
        if loop is None:
            return
        for watch in list(self._watches):
            labels = event["object"]["metadata"].get("labels", {}) if event else {}
            if event is None or _matches(labels, watch.selector):
                loop.call_soon_threadsafe(watch.queue.put_nowait, event)

    # -- the server's side -------------------------------------------------------------------
    def app(self) -> Starlette:
        async def slices(request: Request) -> Response:
            self.loop = asyncio.get_running_loop()
            if request.headers.get("authorization") != f"Bearer {TOKEN}":
                return JSONResponse(_status(401, "Unauthorized", "no valid token"), 401)
            if request.path_params["namespace"] != self.namespace:
                return JSONResponse({"kind": "EndpointSliceList", "items": []})
            query = dict(request.query_params)
            selector = query.get("labelSelector", "")
            if query.get("watch") in ("true", "1", "True"):
                return self._watch(query, selector)
            self.requests.append(("list", query))
            with self._lock:
                items = [
                    copy.deepcopy(s)
                    for s in self.slices.values()
                    if _matches(s["metadata"].get("labels", {}), selector)
                ]
                version = str(self.version)
            return JSONResponse(
                {
                    "apiVersion": "discovery.k8s.io/v1",
                    "kind": "EndpointSliceList",
                    "metadata": {"resourceVersion": version},
                    "items": items,
                }
            )

        async def pod(request: Request) -> Response:
            if request.headers.get("authorization") != f"Bearer {TOKEN}":
                return JSONResponse(_status(401, "Unauthorized", "no valid token"), 401)
            name = request.path_params["name"]
            self.requests.append(("pod", {"name": name}))
            with self._lock:
                found = self.pods.get(name)
                if request.path_params["namespace"] != self.namespace or found is None:
                    return JSONResponse(_status(404, "NotFound", f'pods "{name}" not found'), 404)
                return JSONResponse(copy.deepcopy(found))

        return Starlette(routes=[Route(SLICES_PATH, slices), Route(POD_PATH, pod)])

    def _watch(self, query: dict[str, str], selector: str) -> Response:
        since = int(query.get("resourceVersion") or 0)
        timeout_s = float(query.get("timeoutSeconds") or 300)
        bookmarks = query.get("allowWatchBookmarks") in ("true", "True")
        with self._lock:
            if since < self.compacted_through:
                self.requests.append(("gone", query))
                gone = _status(
                    410, "Expired", f"too old resource version: {since} ({self.compacted_through})"
                )
                return _stream([{"type": "ERROR", "object": gone}])
            self.requests.append(("watch", query))
            backlog = [
                {"type": kind, "object": item}
                for version, kind, item in self.history
                if version > since and _matches(item["metadata"].get("labels", {}), selector)
            ]
            watch = _Watch(asyncio.Queue(), selector)
            self._watches.append(watch)

        async def events() -> AsyncIterator[bytes]:
            try:
                for past in backlog:
                    yield orjson.dumps(past) + b"\n"
                deadline = asyncio.get_running_loop().time() + timeout_s
                while True:
                    left = deadline - asyncio.get_running_loop().time()
                    if left <= 0:
                        if bookmarks:
                            yield orjson.dumps(self._bookmark()) + b"\n"
                        return
                    try:
                        event = await asyncio.wait_for(watch.queue.get(), left)
                    except TimeoutError:
                        continue
                    if event is None:  # expired: the server drops the watch
                        return
                    yield orjson.dumps(event) + b"\n"
            finally:
                with self._lock:
                    self._watches.remove(watch)

        return StreamingResponse(events(), media_type="application/json")

    def _bookmark(self) -> dict[str, Any]:
        with self._lock:
            version = str(self.version)
        return {
            "type": "BOOKMARK",
            "object": {
                "apiVersion": "discovery.k8s.io/v1",
                "kind": "EndpointSlice",
                "metadata": {"resourceVersion": version},
            },
        }


def _status(code: int, reason: str, message: str) -> dict[str, Any]:
    return {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": message,
        "reason": reason,
        "code": code,
    }


def _stream(events: list[dict[str, Any]]) -> Response:
    async def body() -> AsyncIterator[bytes]:
        for event in events:
            yield orjson.dumps(event) + b"\n"

    return StreamingResponse(body(), media_type="application/json")


def write_kubeconfig(path: Path, server: str, namespace: str = "engines") -> Path:
    """A kubeconfig for the stub: a token user and a context whose namespace is `namespace`."""
    path.write_text(
        "apiVersion: v1\n"
        "kind: Config\n"
        "clusters:\n"
        f"- name: stub\n  cluster:\n    server: {server}\n"
        "users:\n"
        f"- name: stub\n  user:\n    token: {TOKEN}\n"
        "contexts:\n"
        f"- name: stub\n  context:\n    cluster: stub\n    user: stub\n    namespace: {namespace}\n"
        "current-context: stub\n"
    )
    return path
