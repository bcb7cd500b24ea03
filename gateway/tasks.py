"""Background tasks a part of the gateway owns, stopped one way everywhere.

`BackgroundTasks.spawn` starts a task and keeps it; `close` cancels every task still running and
waits for them at most `grace_s`: a task that swallows its cancellation (redis-py's pub/sub read
has been seen to) is logged and left, never waited on forever, and a task that failed has its
exception logged rather than lost. Finished tasks are forgotten as they finish, so a part that
spawns one task per event (a probe, a store) holds only the live ones.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine
from typing import Any

log = logging.getLogger(__name__)

DEFAULT_GRACE_S = 2.0
"""How long `close` waits for cancelled tasks: loops here check for cancellation at least
every second."""


class BackgroundTasks:
    def __init__(self, owner: str) -> None:
        self.owner = owner
        self._tasks: set[asyncio.Task[Any]] = set()

    def spawn(
        self, coroutine: Coroutine[Any, Any, Any], name: str | None = None
    ) -> asyncio.Task[Any]:
        task = asyncio.create_task(coroutine, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._done)
        return task

    def _done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error(
                "%s: background task %s failed",
                self.owner,
                task.get_name(),
                exc_info=task.exception(),
            )

    def __len__(self) -> int:
        return len(self._tasks)

    async def close(self, grace_s: float = DEFAULT_GRACE_S) -> None:
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        if not tasks:
            return
        _, pending = await asyncio.wait(tasks, timeout=grace_s)
        for task in pending:
            log.warning(
                "%s: task %s did not stop within %.1f s", self.owner, task.get_name(), grace_s
            )
