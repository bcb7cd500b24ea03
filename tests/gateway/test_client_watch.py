"""`ClientWatch`: a client that leaves cancels the answer's wait (`ClientGone`), and a watch
whose answer came leaves nothing for the cyclic collector."""

from __future__ import annotations

import asyncio
import gc
import weakref

import pytest

from gateway.api.body import ClientWatch
from gateway.errors import ClientGone


def test_a_watched_answer_that_came_leaves_no_cycle_for_the_collector() -> None:
    """The watcher task is cancelled when the answer comes; its `CancelledError`'s traceback
    holds `_until_left`'s frame, which holds the watch, which held the task: a cycle of ~17
    objects a request slower than `WATCH_AFTER_S` (the gateway's `gc.DEBUG_SAVEALL` at bench
    point 2: a watch and a `CancelledError` per request among its garbage). With the collector
    off, the watcher task must be freed by its reference count alone."""
    gone: list[weakref.ref[asyncio.Task[None]]] = []

    async def run() -> None:
        watching, never = asyncio.Event(), asyncio.Event()

        async def left() -> None:
            watching.set()
            await never.wait()

        async def answer() -> None:
            with ClientWatch(left, after_s=0) as watch:
                await watching.wait()  # the watcher awaits the client: the answer comes
                assert watch._watcher is not None
                gone.append(weakref.ref(watch._watcher))

        await asyncio.create_task(answer())
        for _ in range(3):  # the watcher's cancellation is delivered on the loop
            await asyncio.sleep(0)

    gc.collect()
    gc.disable()
    try:
        asyncio.run(run())
        assert len(gone) == 1
        assert gone[0]() is None, gc.get_referrers(gone[0]())
    finally:
        gc.enable()


def test_a_client_that_leaves_cancels_the_wait() -> None:
    async def run() -> None:
        went = asyncio.Event()

        async def left() -> None:
            await went.wait()

        with ClientWatch(left, after_s=0) as watch:
            went.set()
            await asyncio.Event().wait()  # the answer never comes: the watch cancels this
        assert watch  # not reached

    with pytest.raises(ClientGone):
        asyncio.run(run())
