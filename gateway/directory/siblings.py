"""The workers of a pod tell each other what they placed, so each one's local index — what a
lookup falls back to while Redis is away — holds the whole pod's placements, not ~1/N of them.

    worker i ─record(replica, chain, at)─▶ its local index, Redis (write-behind)
                                        └▶ a datagram to every other worker ─▶ their local index

The channel: one `AF_UNIX` datagram socket pair per worker, made by the supervisor
(`gateway.server.workers.placement_sockets`): worker i keeps the receiving end of its own pair
and the sending ends of the others' (several processes may send on one datagram socket: each
datagram arrives whole). A send never blocks: a full queue drops the datagram (counted), which
costs that chain's entry in one worker's fallback only; Redis, the truth, has it. What a worker
receives goes to its local index alone (the sender writes Redis).

A datagram: kind (`R` record, `D` drop), the time of use (float64, the directory clock), the
replica's name (length-prefixed), then the chain's 16-byte hashes, at most
`HASHES_PER_DATAGRAM` of them (a longer chain is sent as several datagrams: the index records
any run of a chain as it would the whole). A malformed datagram is counted and ignored.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import struct
from collections.abc import Sequence
from dataclasses import dataclass

from cachemap.keys import BlockHash
from cachemap.memory import MemoryIndex

log = logging.getLogger(__name__)

HASH_BYTES = 16
HASHES_PER_DATAGRAM = 2048
"""32 KiB of hashes a datagram (a 130k-token prompt is ~2,000 blocks of 256 bytes): well under
the ~208 KB a Linux `AF_UNIX` datagram may be by default."""
RECEIVE_BYTES = 64 * 1024
MAX_PER_WAKE = 256
"""Datagrams applied per wake-up of the receiver; the rest on the next loop turn, so a burst
never holds the loop for long (a record of 2,048 blocks costs ~1 ms)."""
_HEAD = struct.Struct("!cdH")


@dataclass
class SiblingStats:
    sent: int = 0
    dropped: int = 0
    """Datagrams not sent: the receiving worker's queue was full (or it is gone)."""
    received: int = 0
    malformed: int = 0


def encode(kind: bytes, replica: str, hashes: Sequence[BlockHash], at_s: float) -> list[bytes]:
    name = replica.encode()
    head = _HEAD.pack(kind, at_s, len(name)) + name
    return [
        head + b"".join(hashes[i : i + HASHES_PER_DATAGRAM])
        for i in range(0, len(hashes), HASHES_PER_DATAGRAM)
    ]


def decode(datagram: bytes) -> tuple[bytes, str, list[BlockHash], float]:
    """(kind, replica, hashes, at_s); `ValueError` when it is not one of ours."""
    if len(datagram) < _HEAD.size:
        raise ValueError("short datagram")
    kind, at_s, name_len = _HEAD.unpack_from(datagram)
    body = datagram[_HEAD.size + name_len :]
    if kind not in (b"R", b"D") or len(body) % HASH_BYTES or at_s != at_s:
        raise ValueError("not a placement datagram")
    replica = datagram[_HEAD.size : _HEAD.size + name_len].decode()
    hashes = [BlockHash(body[i : i + HASH_BYTES]) for i in range(0, len(body), HASH_BYTES)]
    return kind, replica, hashes, at_s


class Siblings:
    """This worker's ends of the pod's placement channel (module docstring)."""

    def __init__(self, receive: socket.socket, sends: Sequence[socket.socket]) -> None:
        self._receive = receive
        self._sends = list(sends)
        for sock in (receive, *sends):
            sock.setblocking(False)
        self.stats = SiblingStats()
        self._index: MemoryIndex | None = None
        self._reading = False

    def record(self, replica: str, hashes: Sequence[BlockHash], at_s: float) -> None:
        self._send(encode(b"R", replica, hashes, at_s))

    def drop(self, replica: str, hashes: Sequence[BlockHash]) -> None:
        self._send(encode(b"D", replica, hashes, 0.0))

    def _send(self, datagrams: list[bytes]) -> None:
        for sock in self._sends:
            for datagram in datagrams:
                try:
                    sock.send(datagram)
                    self.stats.sent += 1
                except OSError:  # full (EAGAIN), or the worker is gone: Redis has it
                    self.stats.dropped += 1

    def start(self, index: MemoryIndex) -> None:
        """Apply what the other workers place to `index` (this worker's local index)."""
        self._index = index
        asyncio.get_running_loop().add_reader(self._receive.fileno(), self._readable)
        self._reading = True

    def _readable(self) -> None:
        index = self._index
        assert index is not None
        for _ in range(MAX_PER_WAKE):
            try:
                datagram = self._receive.recv(RECEIVE_BYTES)
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                log.warning("the pod's placement channel failed: %s", exc)
                self.close()
                return
            try:
                kind, replica, hashes, at_s = decode(datagram)
            except (ValueError, UnicodeDecodeError, struct.error):
                self.stats.malformed += 1
                continue
            self.stats.received += 1
            if kind == b"R":
                index.record(replica, hashes, at_s)
            else:
                index.drop(replica, hashes)

    def close(self) -> None:
        if self._reading:
            self._reading = False
            asyncio.get_running_loop().remove_reader(self._receive.fileno())
        for sock in (self._receive, *self._sends):
            sock.close()
