"""The response body as Envoy streams it through the picker (FULL_DUPLEX_STREAMED).

A streamed answer (SSE) passes event by event: complete events go back at once, an event cut
by a chunk boundary waits for the rest of it (so the usage event is always whole when it is
read); the first data event is the first token; the usage event goes through the pipeline's
hooks (billing may rewrite it) and is dropped when the client did not ask for usage, exactly as
the standalone gateway's relay does (`gateway.pipeline.exchange.Exchange.batches`). A
non-streamed answer is one JSON object, held until its end, its usage passed the same way.
"""

from __future__ import annotations

import orjson

from gateway.pipeline.relayed import RelayedExchange

_DATA = b"data:"
_USAGE = b'"usage"'


class ResponseRelay:
    def __init__(self, exchange: RelayedExchange, stream: bool, include_usage: bool) -> None:
        self.exchange = exchange
        self.stream = stream
        self.include_usage = include_usage
        self._tail = b""

    async def feed(self, data: bytes, end: bool) -> tuple[bytes, bool]:
        """What to send on for `data`, and whether the first token is in it (the caller runs
        `exchange.first_token()` before it sends the bytes, as the standalone relay does)."""
        if not self.stream:
            self._tail += data
            if not end:
                return b"", False
            return await self._whole(), False
        if b"\r" in data:
            data = data.replace(b"\r\n", b"\n")
        tail = self._tail + data
        if end:
            events, self._tail = tail.split(b"\n\n"), b""
        elif b"\n\n" not in tail:
            self._tail = tail
            return b"", False
        else:
            *events, self._tail = tail.split(b"\n\n")
        first = False
        out = []
        for event in events:
            if not event:
                continue
            if event.startswith(_DATA):
                first = first or not self.exchange.started
                if _USAGE in event and event.startswith(b"data: {"):
                    event = await self._usage_event(event)
                    if not event:
                        continue
            out.append(event + b"\n\n")
        return b"".join(out), first

    async def _usage_event(self, event: bytes) -> bytes:
        try:
            chunk = orjson.loads(event[6:])
        except orjson.JSONDecodeError:
            return event
        usage = chunk.get("usage") if isinstance(chunk, dict) else None
        if not isinstance(usage, dict):
            return event
        await self.exchange.relay_usage(usage)
        if not self.include_usage:
            if not chunk.get("choices"):
                return b""
            chunk.pop("usage", None)
        return b"data: " + orjson.dumps(chunk)

    async def _whole(self) -> bytes:
        body, self._tail = self._tail, b""
        try:
            parsed = orjson.loads(body)
        except orjson.JSONDecodeError:
            return body
        await self.exchange.first_token()
        usage = parsed.get("usage") if isinstance(parsed, dict) else None
        if not isinstance(usage, dict):
            return body
        await self.exchange.relay_usage(usage)
        return orjson.dumps(parsed)
