"""uvicorn's httptools protocol with its keep-alive timeout checked lazily.

uvicorn arms a timer (`call_later`) at the end of every response and cancels it when the next
request's first bytes arrive: a timer made and cancelled a request on a keep-alive connection
(~3.6 µs of uvloop a pair; py-spy at `kvgate bench-cpu`: 1.1% of the gateway's samples in
`call_later` and `_unset_keepalive_if_required`). Here a connection keeps at most one timer: a
response's end notes when the connection went idle and arms one only if none is armed; a
request's bytes only mark it busy. When the timer fires it closes the connection if it has been
idle for `timeout_keep_alive` since its last response, waits the rest if it went idle later,
and does nothing while a request is in flight (its end arms it again): the same deadline as
uvicorn's, never missed, with one timer an idle spell instead of one a request.
"""

from __future__ import annotations

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol


class LazyKeepAlive(HttpToolsProtocol):
    _idle_since_s: float | None = None
    """When the last response ended with nothing after it (None: a request is arriving or in
    flight)."""

    def _unset_keepalive_if_required(self) -> None:
        """uvicorn calls this as a request's bytes arrive: busy now (the timer stays armed)."""
        self._idle_since_s = None

    def on_response_complete(self) -> None:
        """uvicorn's own, but for the keep-alive timer: armed only if none is."""
        self.server_state.total_requests += 1
        if self.transport.is_closing():
            return
        self.flow.resume_reading()
        if self.pipeline:
            cycle, app = self.pipeline.pop()
            self._start_asgi_task(cycle, app)
            return
        self._idle_since_s = self.loop.time()
        if self.timeout_keep_alive_task is None:
            self.timeout_keep_alive_task = self.loop.call_at(
                self._idle_since_s + self.timeout_keep_alive, self.timeout_keep_alive_handler
            )

    def timeout_keep_alive_handler(self) -> None:
        self.timeout_keep_alive_task = None
        idle_since_s = self._idle_since_s
        if idle_since_s is None:
            return  # a request is in flight: its response's end arms the timer again
        due_s = idle_since_s + self.timeout_keep_alive
        if self.loop.time() < due_s:  # it went idle again after the timer was armed
            self.timeout_keep_alive_task = self.loop.call_at(due_s, self.timeout_keep_alive_handler)
            return
        super().timeout_keep_alive_handler()

    def connection_lost(self, exc: Exception | None) -> None:
        super().connection_lost(exc)
        if self.timeout_keep_alive_task is not None:
            self.timeout_keep_alive_task.cancel()
            self.timeout_keep_alive_task = None
