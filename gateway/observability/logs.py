"""The gateway's logs: one format for every logger (kvgate's and uvicorn's), plain or JSON
(`log_format`), and the access log, one line per exchange.

The access line names the request, tenant, model and replica, the status, the token counts,
the timings and the route receipt (policy, reason, matched blocks, the runner-up and the
scores); never a key, a prompt or an answer (it is the log an operator ships anywhere). An
exchange logs its line when it ends (`AccessLog`); a request answered with an error status
instead logs its method, path, status and duration (`log_refusal`)."""

from __future__ import annotations

import logging
import sys
import time
from typing import Any

import orjson

from gateway.request.receipt import receipt_fields
from gateway.request.state import ExchangeRecord, Routed, idle_hook
from gateway.request.usage import EngineUsage

PLAIN_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
ACCESS_LOGGER = "kvgate.access"
access_log = logging.getLogger(ACCESS_LOGGER)


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time, level, logger, message, and a record's `fields`."""

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "time": self.formatTime(record),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        entry.update(getattr(record, "fields", {}))
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return orjson.dumps(entry, default=str).decode()


def configure_logging(level: str, log_format: str) -> None:
    """Every logger through one stderr handler in one format; uvicorn's loggers propagate to it
    (the server runs with `log_config=None`)."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(
        JsonFormatter() if log_format == "json" else logging.Formatter(PLAIN_FORMAT)
    )
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    for name in ("uvicorn", "uvicorn.error", "uvicorn.access"):
        logging.getLogger(name).handlers[:] = []
        logging.getLogger(name).propagate = True


def access_fields(record: ExchangeRecord, now_s: float) -> dict[str, Any]:
    """The access line's fields (no key, no prompt, no answer)."""
    routed = record.routed
    usage: EngineUsage | None = record.usage
    body_id = record.body.get("id") if record.body else None
    return {
        "request_id": record.request_id,
        "response_id": body_id if isinstance(body_id, str) else None,
        "tenant": routed.tenant.name,
        "model": routed.parsed.model,
        "kind": routed.parsed.kind,
        "stream": routed.parsed.stream,
        "replica": record.replica,
        "status": 200,  # an exchange is a committed answer; refusals never reach the engine
        "complete": record.ok,
        "prompt_tokens": usage.prompt_tokens if usage else None,
        "cached_tokens": usage.cached_tokens if usage else None,
        "completion_tokens": usage.completion_tokens if usage else None,
        "ttft_ms": _ms(record.first_token_s - routed.opened_s) if record.first_token_s else None,
        "queue_ms": _ms(routed.queued_s),
        "duration_ms": _ms(now_s - routed.opened_s),
        **_route(routed, record.replica),
    }


def _route(routed: Routed, answered: str) -> dict[str, Any]:
    """The route receipt's fields (gateway.request.receipt); `decided` only when a retry
    answered elsewhere (`replica` is the one that answered)."""
    fields = receipt_fields(routed, answered)
    decided = fields.pop("replica")
    if fields.pop("answered", None) is not None:
        fields["decided"] = decided
    return fields


def _ms(seconds: float) -> float:
    return round(seconds * 1e3, 1)


def log_refusal(method: str, path: str, status: int, seconds: float) -> None:
    """The access line of a request answered with an error before (or instead of) an exchange:
    a refusal (4xx) or a failure (5xx). The tenant is not named (an unauthenticated request
    has none); the path is cut at 200 characters, the query never logged."""
    if not access_log.isEnabledFor(logging.INFO):
        return
    fields = {"method": method, "path": path[:200], "status": status, "duration_ms": _ms(seconds)}
    text = " ".join(f"{k}={v}" for k, v in fields.items())
    access_log.info("%s", text, extra={"fields": fields})


class AccessLog:
    """An exchange observer: one INFO line on `kvgate.access` when an exchange ends."""

    @idle_hook
    async def on_first_token(self, record: ExchangeRecord) -> None:
        return None

    @idle_hook
    async def on_usage(self, record: ExchangeRecord, usage: EngineUsage) -> None:
        return None

    async def on_finish(self, record: ExchangeRecord) -> None:
        if not access_log.isEnabledFor(logging.INFO):
            return
        fields = access_fields(record, time.monotonic())
        text = " ".join(f"{k}={v}" for k, v in fields.items() if v is not None)
        access_log.info("%s", text, extra={"fields": fields})
