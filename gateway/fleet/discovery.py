"""Engine discovery from Kubernetes EndpointSlices: replicas join and leave while the gateway runs.

    API server ──list──▶ every slice matching the selector (+ its resourceVersion)
               ──watch─▶ ADDED / MODIFIED / DELETED / BOOKMARK from that version on
                 │ 410 Gone (the version was compacted away): list again, then watch
                 ▼
    watcher thread ──call_soon_threadsafe──▶ event queue ──▶ Discovery._apply (event loop)
                                                              │ diff of the ready endpoints
                                                              ▼
                                      ReplicaSet.add / remove / hold + RoutingDirectory
                                      register / forget

Why a thread: the official `kubernetes` client is synchronous (urllib3), and its `Watch` blocks
on a chunked HTTP response; the async port is not a dependency we take. One daemon thread per
gateway lists and watches; everything it learns is handed to the event loop, which alone
touches the replica set. `Watch.stop()` shuts the socket down, so stopping is prompt.

What the gateway does with what it sees (invariants):
- The replica set is the static `engines` plus the union of every matching slice's endpoints
  (`http://address:port`, the port chosen by name), keyed by URL, so every gateway derives the
  same replica names and shares one directory.
- An endpoint whose `conditions.ready` is false (starting, failing readiness, terminating) is
  held down: no new request goes to it, and probes do not bring it back until it is ready.
- An endpoint that disappears from every slice has left: it is removed and forgotten in the
  directory (its entries stop matching at once; a pod at that address later is a new cache).
- A pod that restarts is a new epoch: an address whose pod uid (`targetRef.uid`) changed is
  forgotten, and a container restart inside the same pod turns the endpoint not ready and back,
  after which the replica's new start time (or, without one, its coming back up) bumps the
  epoch (gateway.fleet.replicas).
- A gateway that (re)starts lists endpoints that already exist: they join without forgetting,
  so a rolling restart of the gateways does not wipe the shared directory.
- With `pod_annotations`, the watcher reads each new pod (by `targetRef`, once per uid) before
  handing on the slice that names it, so an engine's layout (`ANNOTATIONS`: its KV events
  port, replay port, DP size) is in `layouts` before the replica joins the set and its event
  feeds open; a pod that cannot be read (403, gone) gets the settings' layout, with a warning.

One watch per pod (`kvgate serve --workers N`, issue 17 item 4): worker 0 alone lists and
watches; after every change, and every view period, it sends the endpoint set it reconciled
(each endpoint's readiness, pod and layout) to the other workers on the pod view's channel
(gateway.fleet.podview). A follower reconciles each whole set exactly as worker 0 did its
slices, so every worker routes to the same replicas with the same layouts. A follower that has
had no whole set for the view's staleness bound (`ReplicaSet.stale_after_s`), or none within
the first sync's timeout at its start, lists and watches for itself, as a lone gateway does;
when worker 0's sets come again it stops its watch and follows them.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from cachemap.layouts import DEFAULT_LAYOUT, EngineLayout, EngineLayouts
from gateway.fleet.podview import MemberEntry, ViewReceiver, ViewSender
from gateway.fleet.replicas import ReplicaSet
from gateway.tasks import BackgroundTasks

log = logging.getLogger(__name__)

SERVICE_ACCOUNT_NAMESPACE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")
FIRST_SYNC_TIMEOUT_S = 10.0
"""How long the gateway's start waits for the first list: enough for a slow API server. If the
first attempt fails, or past this, the gateway starts anyway and replicas join when a list
arrives (its readiness says 503 until one is healthy)."""
CONNECT_TIMEOUT_S = 5.0
"""Connecting to the API server; the read side of a watch waits for the watch's own timeout."""
NOT_READY = "not ready in its EndpointSlice"
EVENTS_PORT_ANNOTATION = "kvgate.io/kv-events-port"
REPLAY_PORT_ANNOTATION = "kvgate.io/kv-events-replay-port"
DP_SIZE_ANNOTATION = "kvgate.io/data-parallel-size"
ANNOTATIONS = {
    EVENTS_PORT_ANNOTATION: "events_port",
    REPLAY_PORT_ANNOTATION: "replay_port",
    DP_SIZE_ANNOTATION: "dp_size",
}
"""Pod annotation -> the `EngineLayout` field it sets (docs/precise.md)."""
DECODE_ROLE = "decode"
"""The role value (`KubeTarget.role_key`; llm-d's `llm-d.ai/role: decode`) that puts a pod in
the decode pool; every other value (`prefill`, `both`, `prefill-decode`) and none leave it a
prefill instance, as a static `engines` entry is."""
MAX_PODS_REMEMBERED = 10_000
"""Pods whose annotations the watcher keeps (by uid): more than a fleet's engines, bounded."""


@dataclass(frozen=True)
class Endpoint:
    url: str
    ready: bool
    pod_uid: str | None = None
    pod_name: str | None = None


@dataclass
class DiscoveryStats:
    lists: int = 0
    relists_after_gone: int = 0
    watches: int = 0
    events: int = 0
    errors: int = 0
    joins: int = 0
    leaves: int = 0
    epochs: int = 0
    """Replicas forgotten because their pod was replaced (a new pod uid at the address)."""
    sets_sent: int = 0
    """Worker 0 of a pod: endpoint sets sent to the other workers."""
    sets_applied: int = 0
    """A follower: worker 0's endpoint sets applied."""
    takeovers: int = 0
    """A follower: times worker 0's sets lapsed and this worker watched for itself."""
    synced: bool = False


def _host(address: str, address_type: str) -> str:
    return f"[{address}]" if address_type == "IPv6" and not address.startswith("[") else address


def endpoints_of(
    slice_: dict[str, Any], port_name: str | None, scheme: str = "http"
) -> list[Endpoint]:
    """The endpoints of one EndpointSlice (its JSON form), at the named port.

    `ready` absent means ready (the API's rule). A slice without the port (or, with no name
    given, with several ports) contributes nothing, and says so in the log."""
    ports = slice_.get("ports") or []
    name = (slice_.get("metadata") or {}).get("name", "?")
    if port_name is None:
        chosen = ports[0] if len(ports) == 1 else None
        if chosen is None and ports:
            names = ", ".join(str(p.get("name")) for p in ports)
            log.warning(
                "EndpointSlice %s has several ports (%s): set discovery_port_name", name, names
            )
    else:
        chosen = next((p for p in ports if p.get("name") == port_name), None)
        if chosen is None and ports:
            names = ", ".join(str(p.get("name")) for p in ports)
            log.warning("EndpointSlice %s has no port named %r (it has %s)", name, port_name, names)
    if chosen is None or chosen.get("port") is None:
        return []
    port = int(chosen["port"])
    address_type = str(slice_.get("addressType", "IPv4"))
    found = []
    for endpoint in slice_.get("endpoints") or []:
        conditions = endpoint.get("conditions") or {}
        ready = conditions.get("ready") is not False
        target = endpoint.get("targetRef") or {}
        for address in endpoint.get("addresses") or []:
            found.append(
                Endpoint(
                    f"{scheme}://{_host(address, address_type)}:{port}",
                    ready,
                    target.get("uid"),
                    target.get("name"),
                )
            )
    return found


def layout_of(annotations: dict[str, str], pod: str = "?") -> EngineLayout:
    """The engine layout a pod's annotations give; a value that is not a positive integer (a
    port in 1..65535) is ignored with a warning, so the settings' value applies."""
    values: dict[str, int] = {}
    for key, name in ANNOTATIONS.items():
        raw = annotations.get(key)
        if raw is None:
            continue
        try:
            value = int(raw)
        except ValueError:
            value = 0
        highest = 65535 if name.endswith("_port") else 1 << 16
        if not 1 <= value <= highest:
            log.warning("pod %s: annotation %s=%r is not a valid %s: ignored", pod, key, raw, name)
            continue
        values[name] = value
    return EngineLayout(**values)


def merge(slices: dict[str, list[Endpoint]]) -> dict[str, Endpoint]:
    """One endpoint per URL across slices: ready if any slice says so (a pod moving between
    slices appears in both for a moment)."""
    merged: dict[str, Endpoint] = {}
    for endpoints in slices.values():
        for endpoint in endpoints:
            seen = merged.get(endpoint.url)
            if seen is None or (endpoint.ready and not seen.ready):
                merged[endpoint.url] = endpoint
    return merged


# -- the API server side (a thread) ------------------------------------------------------------
@dataclass
class KubeTarget:
    """Where and what to watch."""

    label_selector: str
    namespace: str | None = None
    port_name: str | None = None
    scheme: str = "http"
    kubeconfig: Path | None = None
    watch_timeout_s: int = 290
    retry_s: float = 2.0
    pod_annotations: bool = False
    """Read each endpoint's Pod for its layout annotations (`ANNOTATIONS`)."""
    role_key: str | None = None
    """A pod label or annotation naming the engine's P/D role (`DECODE_ROLE` or another):
    each endpoint's Pod is read for it (the annotation wins over a label of the same key)."""

    @property
    def reads_pods(self) -> bool:
        return self.pod_annotations or self.role_key is not None


def _api(target: KubeTarget) -> tuple[Any, str]:
    """A DiscoveryV1Api on its own configuration (never the process-wide default: a test runs
    several gateways) and the namespace to watch."""
    from kubernetes import client, config

    configuration = client.Configuration()
    namespace = target.namespace
    if target.kubeconfig is None and "KUBERNETES_SERVICE_HOST" in os.environ:
        config.load_incluster_config(client_configuration=configuration)  # type: ignore[no-untyped-call]
        if namespace is None and SERVICE_ACCOUNT_NAMESPACE.exists():
            namespace = SERVICE_ACCOUNT_NAMESPACE.read_text().strip()
    else:
        path = str(target.kubeconfig) if target.kubeconfig is not None else None
        config.load_kube_config(  # type: ignore[no-untyped-call]
            config_file=path, client_configuration=configuration
        )
        if namespace is None:
            _, active = config.list_kube_config_contexts(config_file=path)  # type: ignore[no-untyped-call]
            namespace = (active or {}).get("context", {}).get("namespace")
    api = client.DiscoveryV1Api(client.ApiClient(configuration))
    return api, namespace or "default"


class SliceWatcher:
    """Lists and watches the matching EndpointSlices in a daemon thread; hands each result to
    `emit` on the event loop: ("sync", {name: slice}) after a list, ("put", slice) and
    ("delete", slice) for watch events, ("error", why) after a failed attempt; with
    `pod_annotations`, ("pods", {uid: annotations}) of the pods a slice names first."""

    def __init__(
        self,
        target: KubeTarget,
        loop: asyncio.AbstractEventLoop,
        emit: Callable[[tuple[str, Any]], None],
        stats: DiscoveryStats,
    ) -> None:
        self.target = target
        self._loop = loop
        self._emit = emit
        self.stats = stats
        self._stopping = threading.Event()
        self._watch: Any = None
        self._pods_read: dict[str, None] = {}
        """uids whose pod was read (insertion order: the oldest forgotten first)"""
        self._thread = threading.Thread(target=self._run, name="kvgate-discovery", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout_s: float = 5.0) -> None:
        self._stopping.set()
        watch = self._watch
        if watch is not None:
            watch.stop()  # shuts the socket down: the blocked read returns
        self._thread.join(timeout_s)

    def _send(self, kind: str, payload: Any) -> None:
        with contextlib.suppress(RuntimeError):  # the loop closed under us: we are stopping
            self._loop.call_soon_threadsafe(self._emit, (kind, payload))

    def _run(self) -> None:
        from kubernetes import watch
        from kubernetes.client.exceptions import ApiException

        try:
            api, namespace = _api(self.target)
        except Exception as exc:
            log.error("Kubernetes discovery cannot start: %s", exc)
            self.stats.errors += 1
            self._send("error", str(exc))
            return
        target = self.target
        log.info(
            "discovering engines: EndpointSlices in %s matching %r",
            namespace,
            target.label_selector,
        )
        gone_in_a_row = 0
        try:
            while not self._stopping.is_set():
                try:
                    version = self._list(api, namespace)
                    while not self._stopping.is_set():
                        self._watch = watch.Watch()  # type: ignore[no-untyped-call]
                        self.stats.watches += 1
                        for event in self._watch.stream(
                            api.list_namespaced_endpoint_slice,
                            namespace,
                            label_selector=target.label_selector,
                            resource_version=version,
                            allow_watch_bookmarks=True,
                            timeout_seconds=target.watch_timeout_s,
                            _request_timeout=(CONNECT_TIMEOUT_S, target.watch_timeout_s + 30),
                        ):
                            self.stats.events += 1
                            gone_in_a_row = 0
                            kind = event["type"]
                            if kind in ("ADDED", "MODIFIED"):
                                self._read_pods(api, namespace, [event["raw_object"]])
                                self._send("put", event["raw_object"])
                            elif kind == "DELETED":
                                self._send("delete", event["raw_object"])
                        # the server closed the watch (its timeout): resume where it ended
                        version = self._watch.resource_version or version
                except ApiException as exc:
                    if self._stopping.is_set():
                        break
                    if exc.status == 410:  # our resourceVersion was compacted away: list again
                        self.stats.relists_after_gone += 1
                        gone_in_a_row += 1
                        log.info("EndpointSlice watch expired (410 Gone): listing again")
                        if gone_in_a_row > 1:  # gone again straight after a list: do not spin
                            self._stopping.wait(target.retry_s)
                        continue
                    self.stats.errors += 1
                    log.warning("EndpointSlice list/watch failed: %s %s", exc.status, exc.reason)
                    self._send("error", exc.status)
                    self._stopping.wait(target.retry_s)
                except Exception as exc:  # the API server is away: retry, never die
                    if self._stopping.is_set():
                        break
                    self.stats.errors += 1
                    log.warning("EndpointSlice list/watch failed: %s", exc)
                    self._send("error", str(exc))
                    self._stopping.wait(target.retry_s)
        finally:
            api.api_client.close()

    def _list(self, api: Any, namespace: str) -> str:
        response = api.list_namespaced_endpoint_slice(
            namespace,
            label_selector=self.target.label_selector,
            _preload_content=False,
            _request_timeout=(CONNECT_TIMEOUT_S, self.target.watch_timeout_s),
        )
        body = json.loads(response.data)
        items = body.get("items") or []
        self.stats.lists += 1
        slices = {item["metadata"]["name"]: item for item in items}
        self._read_pods(api, namespace, items)
        self._send("sync", slices)
        return str(body.get("metadata", {}).get("resourceVersion", ""))

    # -- the gateway side (the event loop) ---------------------------------------------------------
    def _read_pods(self, api: Any, namespace: str, slices: list[dict[str, Any]]) -> None:
        """The annotations of the pods these slices name that were not read yet, sent on."""
        if not self.target.reads_pods:
            return
        from kubernetes import client
        from kubernetes.client.exceptions import ApiException

        core = client.CoreV1Api(api.api_client)
        found: dict[str, dict[str, str]] = {}
        for slice_ in slices:
            for endpoint in slice_.get("endpoints") or []:
                target = endpoint.get("targetRef") or {}
                uid, name = target.get("uid"), target.get("name")
                if target.get("kind") != "Pod" or not uid or not name or uid in self._pods_read:
                    continue
                pod_namespace = target.get("namespace") or namespace
                try:
                    response: Any = core.read_namespaced_pod(
                        name,
                        pod_namespace,
                        _preload_content=False,
                        _request_timeout=(CONNECT_TIMEOUT_S, self.target.watch_timeout_s),
                    )
                    metadata = json.loads(response.data).get("metadata") or {}
                    found[uid] = dict(metadata.get("annotations") or {})
                    role_key, labels = self.target.role_key, metadata.get("labels") or {}
                    if role_key is not None and role_key not in found[uid] and role_key in labels:
                        found[uid][role_key] = str(labels[role_key])
                except ApiException as exc:
                    log.warning(
                        "cannot read pod %s/%s for its annotations (%s %s): the settings' "
                        "events port and DP size apply",
                        pod_namespace,
                        name,
                        exc.status,
                        exc.reason,
                    )
                    found[uid] = {}
                self._pods_read[uid] = None
        while len(self._pods_read) > MAX_PODS_REMEMBERED:
            del self._pods_read[next(iter(self._pods_read))]
        if found:
            self._send("pods", found)


class ReplicaIdentities(Protocol):
    """What discovery tells the directory (`gateway.directory.routing.RoutingDirectory`)."""

    async def forget(self, replica: str) -> None:
        """The replica is a new pod: its entries stop matching."""

    async def left(self, replica: str) -> None:
        """The replica left: its entries stop matching, nothing kept about it stays."""

    def register(self, replicas: Sequence[str]) -> None:
        """Replicas joined: lookups report them from now on."""


class Discovery:
    """Applies what the watcher sees to the replica set and the directory, in order."""

    def __init__(
        self,
        target: KubeTarget,
        replicas: ReplicaSet,
        directory: ReplicaIdentities,
        layouts: EngineLayouts | None = None,
    ) -> None:
        self.target = target
        self.replicas = replicas
        self.directory = directory
        self.layouts = layouts if layouts is not None else EngineLayouts()
        """replica URL -> its pod's layout (written here only; read by the event intake)"""
        self.pods: dict[str, EngineLayout] = {}
        """pod uid -> the layout its annotations give (what the watcher read)"""
        self.roles: dict[str, str] = {}
        """pod uid -> its P/D role (`KubeTarget.role_key`'s value; absent: none)"""
        self.decode: frozenset[str] = frozenset()
        """The discovered replicas in the decode role, as last reconciled."""
        self.on_decode: Callable[[frozenset[str]], None] | None = None
        """Called with `decode` whenever it changes (the P/D pipeline's decode pool)."""
        self.stats = DiscoveryStats()
        self.slices: dict[str, list[Endpoint]] = {}
        """slice name -> its endpoints, as last seen"""
        self.known: dict[str, Endpoint] = {}
        """URL -> the endpoint the replica set reflects"""
        self._queue: asyncio.Queue[tuple[int, str, Any]] = asyncio.Queue()
        """(the watcher's generation, or 0 for worker 0's sets; kind; payload)"""
        self._settled = asyncio.Event()
        """The first list was applied, or the first attempt failed: the start goes on."""
        self._tasks = BackgroundTasks("discovery")
        self._watcher: SliceWatcher | None = None
        self._generation = 0
        """Of the running watcher: events of one stopped since are dropped."""
        self._sender: ViewSender | None = None
        self._receiver: ViewReceiver | None = None
        self._version = 0
        self._desired: dict[str, Endpoint] = {}
        """What the slices (or worker 0's last set) say: worker 0 sends it."""
        self._last_set_s = 0.0

    @property
    def watching(self) -> bool:
        """This gateway lists and watches (a follower only while worker 0's sets lapsed)."""
        return self._watcher is not None

    async def start(self, first_sync_timeout_s: float = FIRST_SYNC_TIMEOUT_S) -> None:
        """Start watching (or, a follower in a pod, following worker 0's endpoint sets) and
        wait (bounded) for the first list or set to be applied, or the first attempt to fail."""
        self._sender, self._receiver = self.replicas.sender, self.replicas.receiver
        self._tasks.spawn(self._consume(), name="discovery-consumer")
        if self._receiver is not None:
            self._receiver.on_members = self._from_worker_0
            self._last_set_s = time.monotonic()
            self._tasks.spawn(self._watch_the_view(first_sync_timeout_s), name="discovery-view")
        else:
            self._start_watcher()
            if self._sender is not None:
                self._tasks.spawn(self._send_every_period(), name="discovery-sets")
        try:
            await asyncio.wait_for(self._settled.wait(), first_sync_timeout_s)
        except TimeoutError:
            log.warning(
                "no EndpointSlice list within %.0f s: starting without discovered engines",
                first_sync_timeout_s,
            )

    def _start_watcher(self) -> None:
        self._generation += 1
        generation = self._generation

        def emit(event: tuple[str, Any]) -> None:
            self._queue.put_nowait((generation, *event))

        self._watcher = SliceWatcher(self.target, asyncio.get_running_loop(), emit, self.stats)
        self._watcher.start()

    async def _stop_watcher(self) -> None:
        watcher, self._watcher = self._watcher, None
        self._generation += 1  # what it emitted and is still queued is dropped
        if watcher is not None:
            await asyncio.to_thread(watcher.stop)

    async def stop(self) -> None:
        await self._stop_watcher()
        await self._tasks.close()
        if self._receiver is not None:
            self._receiver.on_members = None

    # -- one watch per pod (gateway.fleet.podview) ----------------------------------------------
    def _send(self) -> None:
        """Worker 0: the endpoint set, to every follower (once the first list is applied)."""
        if self._sender is None or not self.stats.synced:
            return
        self._version += 1
        self._sender.send_members(
            self._version,
            [
                MemberEntry(e.url, e.ready, e.pod_uid, e.pod_name, self.pods.get(e.pod_uid or ""))
                for e in self._desired.values()
            ],
        )
        self.stats.sets_sent += 1

    async def _send_every_period(self) -> None:
        """Worker 0: the set every view period too, so a follower tells "no change" from
        "worker 0 is gone" (a lost datagram costs one period)."""
        while True:
            await asyncio.sleep(self.replicas.view_period_s())
            self._send()

    async def _from_worker_0(self, entries: list[MemberEntry]) -> None:
        self._queue.put_nowait((0, "members", entries))

    async def _watch_the_view(self, first_sync_timeout_s: float) -> None:
        """A follower: watch for itself when worker 0's sets lapse — none within the first
        sync's timeout at the start, then none for the view's staleness bound."""
        bound = first_sync_timeout_s
        while True:
            await asyncio.sleep(min(bound, self.replicas.view_period_s()))
            if self._watcher is not None:
                continue
            if time.monotonic() - self._last_set_s > bound:
                self.stats.takeovers += 1
                log.warning(
                    "worker 0's EndpointSlice view is older than %.1f s: watching here", bound
                )
                self._start_watcher()
            if self.stats.synced:
                bound = self.replicas.stale_after_s()

    async def _consume(self) -> None:
        while True:
            generation, kind, payload = await self._queue.get()
            if generation and generation != self._generation:
                continue  # a stopped watcher's: worker 0's sets speak now
            try:
                await self._apply(kind, payload)
            except asyncio.CancelledError:
                raise
            except Exception:  # one bad event must not stop discovery
                log.exception("applying an EndpointSlice %s event failed", kind)

    async def _apply(self, kind: str, payload: Any) -> None:
        port, scheme = self.target.port_name, self.target.scheme
        if kind == "error":
            self._settled.set()
            return
        if kind == "members":
            await self._apply_set(payload)
            return
        if kind == "pods":
            role_key = self.target.role_key
            for uid, annotations in payload.items():
                self.pods[uid] = layout_of(annotations, uid)
                if role_key is not None:
                    self.roles[uid] = str(annotations.get(role_key, "")).strip().lower()
            while len(self.pods) > MAX_PODS_REMEMBERED:  # as the watcher forgets them
                del self.pods[next(iter(self.pods))]
            while len(self.roles) > MAX_PODS_REMEMBERED:
                del self.roles[next(iter(self.roles))]
            return
        if kind == "sync":
            self.slices = {name: endpoints_of(item, port, scheme) for name, item in payload.items()}
        else:
            name = payload.get("metadata", {}).get("name", "")
            if kind == "put":
                self.slices[name] = endpoints_of(payload, port, scheme)
            else:
                self.slices.pop(name, None)
        self._desired = merge(self.slices)
        await self.reconcile(self._desired)
        if kind == "sync":
            self.stats.synced = True
            self._settled.set()
        self._send()

    async def _apply_set(self, entries: list[MemberEntry]) -> None:
        """A follower: worker 0's endpoint set, reconciled as its slices were there."""
        self._last_set_s = time.monotonic()
        if self._watcher is not None:
            log.info("worker 0's EndpointSlice view is back: following it")
            await self._stop_watcher()
        for entry in entries:
            if entry.pod_uid is not None and entry.layout is not None:
                self.pods[entry.pod_uid] = entry.layout
        while len(self.pods) > MAX_PODS_REMEMBERED:
            del self.pods[next(iter(self.pods))]
        self._desired = {e.url: Endpoint(e.url, e.ready, e.pod_uid, e.pod_name) for e in entries}
        await self.reconcile(self._desired)
        self.stats.sets_applied += 1
        self.stats.synced = True
        self._settled.set()

    async def reconcile(self, desired: dict[str, Endpoint]) -> None:
        """Make the replica set what the slices say (static engines are left alone)."""
        replicas, directory = self.replicas, self.directory
        for url in [u for u in self.known if u not in desired]:
            del self.known[url]
            if url in replicas.static:
                continue
            replicas.remove(url)
            self.layouts.drop(url)
            self.stats.leaves += 1
            await directory.left(url)
        joined = [u for u in desired if u not in self.known and u not in replicas.static]
        if joined:
            directory.register(joined)
        for url, endpoint in desired.items():
            before = self.known.get(url)
            self.known[url] = endpoint
            if url in replicas.static:
                continue
            held = None if endpoint.ready else NOT_READY
            layout = self.pods.get(endpoint.pod_uid or "", DEFAULT_LAYOUT)
            if before is None:
                self.stats.joins += 1
                self.layouts.set(url, layout)  # before the replica is seen: its feeds' layout
                replicas.add(url, held_down=held)
                continue
            if before.pod_uid and endpoint.pod_uid and before.pod_uid != endpoint.pod_uid:
                log.info(
                    "replica %s is a new pod (%s, was %s): a new epoch",
                    url,
                    endpoint.pod_name,
                    before.pod_name,
                )
                self.stats.epochs += 1
                await directory.forget(url)
                if layout != self.layouts.get(url):
                    # its event feeds were opened for the old layout: keep the two in step
                    log.warning(
                        "replica %s: the new pod %s is annotated with another layout (%s); "
                        "the old one (%s) applies until the address leaves the slices",
                        url,
                        endpoint.pod_name,
                        layout,
                        self.layouts.get(url),
                    )
            replicas.hold(url, held)
        self._update_decode(desired)

    def _update_decode(self, desired: dict[str, Endpoint]) -> None:
        """The decode pool from the pods' roles: a pod that leaves, or whose address a pod of
        another role takes (a new uid, read anew), changes it."""
        if self.target.role_key is None:
            return
        decode = frozenset(
            url
            for url, endpoint in desired.items()
            if url not in self.replicas.static
            and self.roles.get(endpoint.pod_uid or "") == DECODE_ROLE
        )
        if decode != self.decode:
            log.info(
                "P/D roles from %s: decode pool %s",
                self.target.role_key,
                ", ".join(sorted(decode)) or "empty",
            )
            self.decode = decode
            if self.on_decode is not None:
                self.on_decode(decode)
