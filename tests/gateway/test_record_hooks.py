"""The recorder's per-exchange costs: idle observer hooks are not awaited, and request ids are
drawn in batches yet never shared (not even by a forked child)."""

from __future__ import annotations

import os
import re
from types import SimpleNamespace
from typing import Any

from gateway.pipeline.record import Recorder
from gateway.request.state import idle_hook, new_request_id


class _Observer:
    def __init__(self) -> None:
        self.calls: list[str] = []

    @idle_hook
    async def on_first_token(self, record: Any) -> None:
        self.calls.append("first_token")  # marked idle: the recorder must not await it

    async def on_usage(self, record: Any, usage: Any) -> None:
        self.calls.append("usage")

    async def on_finish(self, record: Any) -> None:
        self.calls.append("finish")


async def test_the_recorder_awaits_every_hook_but_the_idle_ones_in_order() -> None:
    first, second = _Observer(), _Observer()
    recorder = Recorder(SimpleNamespace(), SimpleNamespace(), [first, second])  # type: ignore[arg-type]
    routed = SimpleNamespace(hashes=(), unpredicted=frozenset())
    record = SimpleNamespace(routed=routed, replica="r", first_token_s=None)
    trace = SimpleNamespace(finished=lambda record: first.calls.append("traced"))
    exchange = SimpleNamespace(record=record, trace=trace)
    await recorder.first_token(exchange)  # type: ignore[arg-type]
    await recorder.finish(exchange)  # type: ignore[arg-type]
    assert record.first_token_s is not None
    assert first.calls == ["finish", "traced"]
    assert second.calls == ["finish"]
    assert recorder.observers == [first, second]


def test_request_ids_are_96_random_bits_and_never_repeat() -> None:
    ids = [new_request_id() for _ in range(3_000)]  # several batches
    assert len(set(ids)) == len(ids)
    assert all(re.fullmatch(r"req_[0-9a-f]{24}", i) for i in ids)


def test_a_forked_child_does_not_reuse_its_parents_unused_ids() -> None:
    new_request_id()  # the batch is drawn: its rest waits in the parent
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: its next id, then exit without running the parent's teardown
        os.close(read)
        os.write(write, new_request_id().encode())
        os._exit(0)
    os.close(write)
    with os.fdopen(read, "rb") as pipe:
        child = pipe.read().decode()
    os.waitpid(pid, 0)
    parent = {new_request_id() for _ in range(300)}
    assert re.fullmatch(r"req_[0-9a-f]{24}", child)
    assert child not in parent
