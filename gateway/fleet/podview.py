"""One prober and scraper per pod (issue 17 item 4): worker 0 probes and scrapes the replicas,
and sends what it found — each replica's health, models and engine figures — to the other
workers, which route on it instead of probing and scraping every replica themselves.

The channel: one `AF_UNIX` datagram socket pair per other worker, made by the supervisor
(`gateway.server.workers`) and inherited by both ends (`worker_view_fds`). Worker 0 sends
after each probe round, each scrape round and each change of a replica's health; a send never
blocks (a full queue drops the datagram: a later one carries the same replicas, newer). Each
datagram is a self-contained list of replica entries (`VIEW_CHUNK_BYTES` at most), so a large
fleet spans several and a lost one costs only its replicas' freshness. No Redis round trip and
no polling: an idle follower wakes only when a datagram arrives.

Time: the entries carry `time.monotonic()` stamps of worker 0 (when it last heard from the
replica, marked it down, scraped it). Every worker of a pod is a process on the same Linux
kernel, whose CLOCK_MONOTONIC is one clock system-wide, so a follower compares them with its
own stamps directly: the newer evidence of up or down wins (`ReplicaSet.adopt`).

Staleness: a follower counts a replica as covered by the view until `stale_after_s` past the
last entry it received for it; after that its own probe and scrape loops take the replica back
(`ReplicaSet.probe_all`), as a lone gateway's would, until entries arrive again.

Membership (Kubernetes discovery, one EndpointSlice watch per pod): worker 0 alone watches, and
sends the endpoint set it derived — every endpoint with its readiness, pod and layout — on the
same channel after each change and every view period (`encode_members`). A set is numbered and
may span several datagrams (`VIEW_CHUNK_BYTES` each); a follower applies it only once every
part of one number has arrived (`MembersAssembly`), so a lost part delays a change by a period
and never applies half a set (half a set would remove the other half's replicas). A follower
that has not had a whole set for the staleness bound watches for itself
(gateway.fleet.discovery).
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Awaitable, Callable, Iterable, Iterator
from dataclasses import asdict, dataclass

import orjson

from cachemap.layouts import EngineLayout
from gateway.fleet.engine_metrics import EngineMetrics

log = logging.getLogger(__name__)

VIEW_CHUNK_BYTES = 32 * 1024
"""The most one datagram carries (~250 replicas of ~130 bytes): well under the ~208 KB a Linux
`AF_UNIX` datagram may be by default (`net.core.wmem_default`), so no fleet size needs a
tuned kernel; a larger fleet is sent as several datagrams."""
RECEIVE_BYTES = 256 * 1024
"""The receive buffer for one datagram: larger than any `VIEW_CHUNK_BYTES` chunk."""
MAX_MEMBER_PARTS = 1024
"""The most datagrams one endpoint set may span (~200k endpoints): a part numbered past it is
malformed, so a follower's assembly stays bounded whatever it is sent."""


@dataclass(frozen=True)
class ViewEntry:
    """What worker 0 knows of one replica (its `ReplicaState`'s shared part)."""

    url: str
    healthy: bool
    since_s: float
    """Worker 0's latest evidence of that health (monotonic): its last answer if healthy, the
    time it was marked down if not."""
    models: tuple[str, ...] = ()
    max_model_len: int | None = None
    metrics: EngineMetrics | None = None
    scraped_s: float = 0.0
    """When `metrics` was read (monotonic); 0: never."""


def encode(entries: Iterable[ViewEntry]) -> Iterator[bytes]:
    """The entries as datagrams of at most `VIEW_CHUNK_BYTES` (one entry alone may exceed it
    only by its own size; it is then sent alone)."""
    chunk: list[bytes] = []
    size = 2
    for entry in entries:
        item = orjson.dumps(_plain(entry))
        if chunk and size + len(item) + 1 > VIEW_CHUNK_BYTES:
            yield b"[" + b",".join(chunk) + b"]"
            chunk, size = [], 2
        chunk.append(item)
        size += len(item) + 1
    if chunk:
        yield b"[" + b",".join(chunk) + b"]"


def _plain(entry: ViewEntry) -> dict[str, object]:
    item: dict[str, object] = {"u": entry.url, "h": entry.healthy, "t": entry.since_s}
    if entry.models:
        item["m"] = entry.models
    if entry.max_model_len is not None:
        item["l"] = entry.max_model_len
    if entry.metrics is not None:
        item["x"] = {k: v for k, v in asdict(entry.metrics).items() if v is not None}
        item["s"] = entry.scraped_s
    return item


def decode(datagram: bytes) -> list[ViewEntry]:
    """A datagram's entries; ValueError (or a KeyError/TypeError from a malformed item) when it
    is not one `encode` wrote."""
    entries = []
    for item in orjson.loads(datagram):
        metrics = item.get("x")
        entries.append(
            ViewEntry(
                url=str(item["u"]),
                healthy=bool(item["h"]),
                since_s=float(item["t"]),
                models=tuple(str(m) for m in item.get("m", ())),
                max_model_len=item.get("l"),
                metrics=EngineMetrics(**metrics) if metrics is not None else None,
                scraped_s=float(item.get("s", 0.0)),
            )
        )
    return entries


@dataclass(frozen=True)
class MemberEntry:
    """One endpoint of worker 0's EndpointSlices, as discovery derived it."""

    url: str
    ready: bool
    pod_uid: str | None = None
    pod_name: str | None = None
    layout: EngineLayout | None = None
    """The layout the pod's annotations give (None: none read, the settings' values apply)."""


@dataclass(frozen=True)
class MembersPart:
    """Part `index` of `parts` of endpoint set number `version`."""

    version: int
    index: int
    parts: int
    entries: tuple[MemberEntry, ...]


def encode_members(version: int, entries: Iterable[MemberEntry]) -> list[bytes]:
    """Endpoint set `version` as datagrams of at most `VIEW_CHUNK_BYTES` (plus its header); an
    empty set is one datagram with no entries (it removes every discovered replica)."""
    chunks: list[list[bytes]] = [[]]
    size = 0
    for entry in entries:
        item = orjson.dumps(_plain_member(entry))
        if chunks[-1] and size + len(item) + 1 > VIEW_CHUNK_BYTES:
            chunks.append([])
            size = 0
        chunks[-1].append(item)
        size += len(item) + 1
    return [
        b'{"k":"members","v":%d,"i":%d,"n":%d,"e":[%s]}'
        % (version, index, len(chunks), b",".join(chunk))
        for index, chunk in enumerate(chunks)
    ]


def _plain_member(entry: MemberEntry) -> dict[str, object]:
    item: dict[str, object] = {"u": entry.url, "r": entry.ready}
    if entry.pod_uid is not None:
        item["p"] = entry.pod_uid
    if entry.pod_name is not None:
        item["n"] = entry.pod_name
    if entry.layout is not None:
        item["l"] = {k: v for k, v in asdict(entry.layout).items() if v is not None}
    return item


def _member(item: dict[str, object]) -> MemberEntry:
    layout = item.get("l")
    uid, name = item.get("p"), item.get("n")
    return MemberEntry(
        url=str(item["u"]),
        ready=bool(item["r"]),
        pod_uid=None if uid is None else str(uid),
        pod_name=None if name is None else str(name),
        layout=None if layout is None else EngineLayout(**layout),  # type: ignore[arg-type]
    )


def decode_message(datagram: bytes) -> list[ViewEntry] | MembersPart:
    """A datagram's view entries (`encode`) or endpoint-set part (`encode_members`); ValueError
    (or a KeyError/TypeError from a malformed item) when it is neither."""
    message = orjson.loads(datagram)
    if not isinstance(message, dict):
        return decode(datagram)
    if message.get("k") != "members":
        raise ValueError(f"unknown pod view message {message.get('k')!r}")
    version, index, parts = int(message["v"]), int(message["i"]), int(message["n"])
    if not 0 <= index < parts <= MAX_MEMBER_PARTS:
        raise ValueError(f"endpoint set part {index} of {parts}")
    return MembersPart(version, index, parts, tuple(_member(item) for item in message["e"]))


class MembersAssembly:
    """A follower's parts of the newest endpoint set: a whole set once every part is here.
    Parts of an older set than one already begun or applied are dropped (bounded: one set's
    parts at most)."""

    def __init__(self) -> None:
        self.version = -1
        self.applied = -1
        self._parts: dict[int, tuple[MemberEntry, ...]] = {}
        self._count = 0

    def add(self, part: MembersPart) -> list[MemberEntry] | None:
        """The whole set `part` completes, or None (not whole yet, or older)."""
        if part.version < self.version or part.version <= self.applied:
            return None
        if part.version > self.version:
            self.version, self._parts, self._count = part.version, {}, part.parts
        if part.parts != self._count:
            return None  # a part of the same number that disagrees: not one `encode_members`
        self._parts[part.index] = part.entries
        if len(self._parts) < self._count:
            return None
        self.applied = part.version
        whole = [entry for i in range(self._count) for entry in self._parts[i]]
        self._parts = {}
        return whole


class ViewSender:
    """Worker 0's end: one socket per other worker. `send` never blocks nor raises."""

    def __init__(self, socks: list[socket.socket]) -> None:
        for sock in socks:
            sock.setblocking(False)
        self.socks = socks
        self.sent = 0
        self.dropped = 0
        """Datagrams a follower's full queue (or a closed end) refused: it is busy or gone, and
        the next round sends the same replicas again."""

    def send(self, entries: Iterable[ViewEntry]) -> None:
        datagrams = list(encode(entries))
        for sock in self.socks:
            for datagram in datagrams:
                try:
                    sock.send(datagram)
                    self.sent += 1
                except OSError:  # BlockingIOError (queue full), ECONNREFUSED, EMSGSIZE...
                    self.dropped += 1

    def send_members(self, version: int, entries: Iterable[MemberEntry]) -> None:
        """Endpoint set `version` to every follower (never blocks nor raises)."""
        datagrams = encode_members(version, entries)
        for sock in self.socks:
            for datagram in datagrams:
                try:
                    sock.send(datagram)
                    self.sent += 1
                except OSError:
                    self.dropped += 1

    def close(self) -> None:
        for sock in self.socks:
            sock.close()


class ViewReceiver:
    """A follower's end: every datagram's entries go to `adopt`, in order; each whole endpoint
    set to `on_members` (set by discovery; None: sets are dropped)."""

    def __init__(
        self, sock: socket.socket, adopt: Callable[[list[ViewEntry]], Awaitable[None]]
    ) -> None:
        sock.setblocking(False)
        self.sock = sock
        self._adopt = adopt
        self.on_members: Callable[[list[MemberEntry]], Awaitable[None]] | None = None
        self.members = MembersAssembly()
        self.received = 0
        self.malformed = 0

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            try:
                datagram = await loop.sock_recv(self.sock, RECEIVE_BYTES)
            except OSError as exc:  # the source is gone: the view lapses, we probe ourselves
                log.warning("the pod view's source is gone: %s", exc)
                return
            if not datagram:  # worker 0 never sends an empty one
                log.warning("the pod view's source closed it")
                return
            try:
                message = decode_message(datagram)
            except (ValueError, KeyError, TypeError) as exc:
                self.malformed += 1
                log.warning("a pod view datagram did not decode (%d bytes): %s", len(datagram), exc)
                continue
            self.received += 1
            if isinstance(message, MembersPart):
                whole = self.members.add(message)
                if whole is not None and self.on_members is not None:
                    await self.on_members(whole)
            else:
                await self._adopt(message)

    def close(self) -> None:
        self.sock.close()
