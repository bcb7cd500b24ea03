"""A TCP proxy on loopback that can stall: a slow Redis (or any server) between two processes.

`StallProxy(upstream_port)` listens on a free port in a thread of its own (its own event loop)
and pipes bytes both ways. While `delay_s` is above zero every chunk from upstream waits that
long before it is passed on: each reply arrives late, as from a server stalled in a long command
or a congested link, while the connection stays open. With `stall_pattern` set, only the
connections that have sent those bytes (e.g. one script's SHA: its lookups) stall; the others
(PINGs, other scripts) pass at once. Closed with `close()` (or as a context).
"""

from __future__ import annotations

import asyncio
import threading
from types import TracebackType

from loadgen.harness.processes import free_port

START_TIMEOUT_S = 10.0


class StallProxy:
    def __init__(self, upstream_port: int, upstream_host: str = "127.0.0.1") -> None:
        self.upstream = (upstream_host, upstream_port)
        self.port = free_port()
        self.delay_s = 0.0
        self.stall_pattern: bytes | None = None
        """Stall only the connections whose client sent these bytes (None: every connection)."""
        self.stalled_chunks = 0
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._stop: asyncio.Event | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._thread = threading.Thread(target=self._run, daemon=True, name="stall-proxy")
        self._thread.start()
        if not self._ready.wait(START_TIMEOUT_S):
            raise TimeoutError(f"the stall proxy did not start in {START_TIMEOUT_S} s")

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}"

    def _run(self) -> None:
        try:
            self._loop.run_until_complete(self._serve())
        finally:
            self._loop.close()

    async def _serve(self) -> None:
        self._stop = asyncio.Event()
        server = await asyncio.start_server(self._connection, "127.0.0.1", self.port)
        self._ready.set()
        async with server:
            await self._stop.wait()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _connection(
        self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter
    ) -> None:
        try:
            up_r, up_w = await asyncio.open_connection(*self.upstream)
        except OSError:
            client_w.close()
            return
        matched = [False]  # this connection's client sent `stall_pattern`
        for pipe in (
            self._pipe(client_r, up_w, stall=False, matched=matched),
            self._pipe(up_r, client_w, stall=True, matched=matched),
        ):
            task = asyncio.create_task(pipe)  # tracked: every pipe ends before the loop does
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _pipe(
        self, r: asyncio.StreamReader, w: asyncio.StreamWriter, stall: bool, matched: list[bool]
    ) -> None:
        try:
            while chunk := await r.read(65536):
                pattern = self.stall_pattern
                if not stall and pattern is not None and pattern in chunk:
                    matched[0] = True
                if stall and self.delay_s > 0 and (pattern is None or matched[0]):
                    self.stalled_chunks += 1
                    await asyncio.sleep(self.delay_s)
                w.write(chunk)
                await w.drain()
        except (OSError, asyncio.CancelledError):
            pass
        finally:
            w.close()

    def close(self) -> None:
        if self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(timeout=10)

    def __enter__(self) -> StallProxy:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()
