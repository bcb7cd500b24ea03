"""The console: live pages on the admin port for an operator's questions.

    GET  /console                 the fleet: each replica's health, load, KV used, indexed
                                  blocks by tier, KV events flowing or predicted
    GET  /console/routing         hit ratio and decisions over time, hot prefixes, fan-out
                                  holds, the shared directory's lookups
    GET  /console/tenants         per tenant over a window: tokens (read, written, cached share),
                                  spend and savings against no caching (billing on)
    GET  /console/requests[?id=]  one request's route receipt (candidates, matched blocks,
                                  scores, why this one); the latest ones
    GET  /console/state.json      what the pages poll (every 2 s while one is open)
    POST /console/login           an admin key into an HttpOnly cookie (when admin keys exist)
    GET  /console/static/*        uPlot (MIT, vendored: the pod may have no internet), the
                                  pages' script and style

Server-rendered: each page comes with its tables filled from the gateway's state; its script
then polls `state.json` and keeps the time series in the browser, so the gateway keeps no
history for the console and does no work while nobody looks (the request lookup reads
`RecentRoutes`, which the exchanges fill anyway). The state is the registry's own families (what
`/metrics` exports, read in process) and the recent receipts: tenant names and counts, never a
prompt or an answer. Behind the admin keys when `admin_keys` is set (a bearer key, or the
cookie the login form sets); never on the tenants' port.
"""

from __future__ import annotations

import html
import math
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import orjson
from aiohttp import web
from prometheus_client import CollectorRegistry

from gateway.observability.recent import RecentRoutes
from gateway.request.tenant import hash_key
from gateway.tenancy.registry import bearer_key

STATIC = Path(__file__).with_name("static")
COOKIE = "kvgate_admin"
PAGES = (
    ("/console", "Fleet"),
    ("/console/routing", "Routing"),
    ("/console/tenants", "Tenants"),
    ("/console/requests", "Requests"),
)
LATEST_SHOWN = 20
Samples = dict[str, list[tuple[dict[str, str], float]]]


def families(registry: CollectorRegistry) -> Samples:
    """Every sample of the registry by its name: (labels, value), finite values only."""
    out: Samples = {}
    for family in registry.collect():
        for sample in family.samples:
            if math.isfinite(sample.value):
                out.setdefault(sample.name, []).append((dict(sample.labels), sample.value))
    return out


def by(samples: Samples, name: str, label: str) -> dict[str, float]:
    """label value -> the sum of the samples of `name` that carry it"""
    out: dict[str, float] = {}
    for labels, value in samples.get(name, ()):
        key = labels.get(label, "")
        out[key] = out.get(key, 0.0) + value
    return out


class Console:
    """The console's routes on the admin server."""

    def __init__(
        self,
        registry: CollectorRegistry,
        recent: RecentRoutes,
        admin_hashes: frozenset[str],
    ) -> None:
        self.registry = registry
        self.recent = recent
        self._admin_hashes = admin_hashes

    def add_routes(self, app: web.Application) -> None:
        app.router.add_get("/console", self._fleet)
        app.router.add_get("/console/routing", self._routing)
        app.router.add_get("/console/tenants", self._tenants)
        app.router.add_get("/console/requests", self._requests)
        app.router.add_get("/console/state.json", self._state)
        app.router.add_post("/console/login", self._login)
        app.router.add_static("/console/static", STATIC, show_index=False)

    # -- access --
    def _allowed(self, request: web.Request) -> bool:
        hashes = self._admin_hashes
        if not hashes:
            return True
        key = (
            bearer_key(request.headers.get("authorization")) or request.cookies.get(COOKIE) or None
        )
        return key is not None and hash_key(key) in hashes

    def _login_page(self, status: int) -> web.Response:
        form = (
            '<form method="post" action="/console/login"><label>Admin key '
            '<input type="password" name="key" autocomplete="off"></label> '
            '<button type="submit">Sign in</button></form>'
        )
        body = "<p>This console needs an admin key (<code>admin_keys</code>).</p>" + form
        return web.Response(
            text=_page("Sign in", "", body, poll=False), content_type="text/html", status=status
        )

    async def _login(self, request: web.Request) -> web.Response:
        key = str((await request.post()).get("key", ""))
        if not key or hash_key(key) not in self._admin_hashes:
            return self._login_page(401)
        response = web.Response(status=303, headers={"location": "/console"})
        response.set_cookie(COOKIE, key, httponly=True, samesite="Strict", path="/console")
        return response

    # -- pages --
    async def _fleet(self, request: web.Request) -> web.Response:
        return self._render(request, "/console", self._fleet_body)

    async def _routing(self, request: web.Request) -> web.Response:
        return self._render(request, "/console/routing", self._routing_body)

    async def _tenants(self, request: web.Request) -> web.Response:
        return self._render(request, "/console/tenants", self._tenants_body)

    async def _requests(self, request: web.Request) -> web.Response:
        wanted = request.query.get("id", "").strip()
        return self._render(request, "/console/requests", lambda s: self._requests_body(wanted))

    def _render(
        self, request: web.Request, path: str, body: Callable[[Samples], str]
    ) -> web.Response:
        if not self._allowed(request):
            return self._login_page(401)
        title = dict(PAGES)[path]
        return web.Response(
            text=_page(title, path, body(families(self.registry))), content_type="text/html"
        )

    async def _state(self, request: web.Request) -> web.Response:
        if not self._allowed(request):
            return web.json_response({"error": "this needs an admin key"}, status=401)
        samples = families(self.registry)
        state = {
            "samples": {k: [[labels, v] for labels, v in vs] for k, vs in samples.items()},
            "recent": self.recent.latest(LATEST_SHOWN),
        }
        return web.Response(body=orjson.dumps(state), content_type="application/json")

    # -- bodies (server-rendered; the script refreshes the parts marked data-live) --
    def _fleet_body(self, s: Samples) -> str:
        healthy = by(s, "kvgate_replica_healthy", "replica")
        columns = (
            ("in flight", "kvgate_replica_inflight"),
            ("pending prefill tokens", "kvgate_replica_pending_prefill_tokens"),
            ("engine waiting", "kvgate_engine_num_waiting"),
            ("engine running", "kvgate_engine_num_running"),
            ("KV used", "kvgate_engine_kv_usage"),
            ("attempts", "kvgate_replica_requests_total"),
        )
        values = {name: by(s, name, "replica") for _, name in columns}
        rows = []
        for replica in sorted(healthy):
            cells = [_td(replica), _td("up" if healthy[replica] else "down")]
            for _, name in columns:
                value = values[name].get(replica)
                cells.append(_td(_fmt(value, percent=name == "kvgate_engine_kv_usage")))
            rows.append(cells)
        header = ["replica", "health", *(c for c, _ in columns)]
        blocks = _tier_table(s)
        return (
            _table("replicas", header, rows)
            + blocks
            + _chart("inflight", "In flight per replica")
            + _chart("attempts", "Attempts per second per replica")
        )

    def _routing_body(self, s: Samples) -> str:
        decisions = [
            [_td(labels.get("policy", "")), _td(labels.get("reason", "")), _td(_fmt(v))]
            for labels, v in s.get("kvgate_routing_decisions_total", ())
        ]
        hot = [
            [_td(labels.get("prefix", "")), _td(_fmt(v))]
            for labels, v in s.get("kvgate_hot_prefix_replicas", ())
        ]
        lookups = [
            [_td(source), _td(_fmt(v))]
            for source, v in sorted(by(s, "kvgate_directory_lookups_total", "source").items())
        ]
        holds = _fmt(sum(v for _, v in s.get("kvgate_fanout_holds_total", ())))
        return (
            _chart("hit", "Prompt tokens found cached (engines reported), over time")
            + _chart("decisions", "Routing decisions per second, by reason")
            + _table("decisions", ["policy", "reason", "decisions"], decisions)
            + _table("hot", ["hot prefix", "replicas (k)"], hot)
            + f'<p>Fan-out siblings held: <span data-live="holds">{holds}</span></p>'
            + _table("lookups", ["directory lookups by source", "lookups"], lookups)
        )

    def _tenants_body(self, s: Samples) -> str:
        tokens: dict[str, dict[str, float]] = {}
        for labels, v in s.get("kvgate_tenant_tokens_total", ()):
            tokens.setdefault(labels.get("tenant", ""), {})[labels.get("kind", "")] = v
        queued = by(s, "kvgate_flow_queue_depth", "tenant")
        cost: dict[str, dict[str, float]] = {}
        for labels, v in s.get("kvgate_tenant_cost_dollars_total", ()):
            cost.setdefault(labels.get("tenant", ""), {})[labels.get("basis", "")] = v
        rows = []
        for tenant in sorted(set(tokens) | set(queued) | set(cost)):
            kinds = tokens.get(tenant, {})
            prompt = kinds.get("prompt", 0.0)
            share = kinds.get("cache_read", 0.0) / prompt if prompt else None
            billed, without = (
                cost.get(tenant, {}).get("billed"),
                cost.get(tenant, {}).get("without_caching"),
            )
            saved = without - billed if billed is not None and without is not None else None
            rows.append(
                [
                    _td(tenant),
                    *(_td(_fmt(kinds.get(k))) for k in ("prompt", "cache_read", "cache_written")),
                    _td(_fmt(kinds.get("completion"))),
                    _td(_fmt(share, percent=True)),
                    _td(_money(billed)),
                    _td(_money(without)),
                    _td(_money(saved)),
                    _td(_fmt(saved / without if saved is not None and without else None, True)),
                    _td(_fmt(queued.get(tenant, 0.0))),
                ]
            )
        header = [
            "tenant",
            "prompt",
            "read (cached)",
            "written",
            "completion",
            "cached share",
            "spend",
            "without caching",
            "saved",
            "saved share",
            "queued now",
        ]
        window = (
            '<p>Window: <select id="window"><option value="60">1 min</option>'
            '<option value="300" selected>5 min</option><option value="900">15 min</option>'
            '<option value="0">since start</option></select> (rates over the window are '
            "counted while this page is open; the table opens with totals since start). Spend "
            "is what billing charged (the tenant's profile and prices); without caching is the "
            "same exchanges with every prompt token at the input price (billing off: –).</p>"
        )
        return (
            window
            + _table("tenants", header, rows)
            + _chart("tenant_spend", "Spend, $ per minute by tenant (billing on)")
            + _chart("tenant_tokens", "Prompt tokens/s by tenant")
            + _chart("queued", "Requests waiting in the gateway (fair flow control), by tenant")
        )

    def _requests_body(self, wanted: str) -> str:
        form = (
            '<form method="get" action="/console/requests"><label>Request id '
            f'<input name="id" value="{html.escape(wanted)}" size="40"></label> '
            '<button type="submit">Look up</button></form>'
        )
        found = ""
        if wanted:
            entry = self.recent.get(wanted)
            found = (
                _receipt(entry)
                if entry
                else f'<p class="miss">No recent request {html.escape(wanted)}.</p>'
            )
        latest = [
            [
                _td(
                    f'<a href="/console/requests?id={html.escape(e["request_id"])}">'
                    f"{html.escape(e['request_id'])}</a>",
                    raw=True,
                ),
                _td(e["tenant"]),
                _td(e["policy"]),
                _td(e["reason"]),
                _td(e["replica"]),
                _td(e["matched"]),
            ]
            for e in self.recent.latest(LATEST_SHOWN)
        ]
        table = _table(
            "latest", ["request", "tenant", "policy", "reason", "replica", "matched"], latest
        )
        return form + found + "<h2>Latest</h2>" + table


def _receipt(entry: dict[str, Any]) -> str:
    facts = [
        ("request", entry["request_id"]),
        ("tenant", entry["tenant"]),
        ("model", entry["model"]),
        ("policy", entry["policy"]),
        ("why", entry["reason"]),
        ("chosen", entry["replica"]),
        ("answered", entry.get("answered", entry["replica"])),
        ("matched blocks", entry["matched"]),
        ("runner-up", entry.get("runner_up", "none")),
        ("prompt / cached tokens", f"{entry['prompt_tokens']} / {entry['cached_tokens']}"),
        ("time to first token", f"{entry['ttft_ms']} ms"),
    ]
    dl = "".join(f"<dt>{html.escape(k)}</dt><dd>{html.escape(str(v))}</dd>" for k, v in facts)
    candidates = [
        [_td(c["replica"]), _td(str(c["matched"])), _td(_fmt(c["score"]))]
        for c in entry["candidates"]
    ]
    return (
        f'<section id="receipt"><h2>Route receipt</h2><dl>{dl}</dl>'
        + _table("candidates", ["candidate (ranked)", "matched blocks", "score"], candidates)
        + "</section>"
    )


def _tier_table(s: Samples) -> str:
    """Precise mode: blocks the KV events say each cache domain holds, by tier."""
    rows: dict[str, dict[str, float]] = {}
    for labels, v in s.get("kvgate_events_indexed_blocks", ()):
        rows.setdefault(labels.get("domain", ""), {})[labels.get("tier", "")] = v
    if not rows:
        return "<p>KV events: off (residency is predicted from what the gateway routed).</p>"
    tiers = sorted({t for r in rows.values() for t in r})
    body = [[_td(d), *(_td(_fmt(r.get(t))) for t in tiers)] for d, r in sorted(rows.items())]
    return _table("tiers", ["cache domain (KV events flowing)", *tiers], body)


def _fmt(value: float | None, percent: bool = False) -> str:
    if value is None:
        return "–"
    if percent:
        return f"{value * 100:.1f}%"
    return f"{value:,.0f}" if float(value).is_integer() or abs(value) >= 100 else f"{value:.3g}"


def _money(value: float | None) -> str:
    """Dollars for a person: cents from $1 up, four significant digits below (a request costs
    fractions of a cent). Exact figures are billing's (`kvgate billing summary`)."""
    if value is None:
        return "–"
    if abs(value) >= 1:
        return f"${value:,.2f}"
    return "$" + f"{float(f'{value:.4g}'):.10f}".rstrip("0").rstrip(".") if value else "$0"


def _td(value: str, raw: bool = False) -> str:
    return f"<td>{value if raw else html.escape(value)}</td>"


def _table(name: str, header: Iterable[str], rows: list[list[str]]) -> str:
    head = "".join(f"<th>{html.escape(h)}</th>" for h in header)
    body = "".join("<tr>" + "".join(r) + "</tr>" for r in rows) or (
        '<tr><td class="empty" colspan="99">nothing yet</td></tr>'
    )
    return f'<table data-live="{name}"><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>'


def _chart(name: str, title: str) -> str:
    chart = f'<div class="chart" data-chart="{name}" data-points="0"></div>'
    return f"<figure><figcaption>{html.escape(title)}</figcaption>{chart}</figure>"


def _page(title: str, path: str, body: str, poll: bool = True) -> str:
    here = ' class="here"'
    nav = "".join(f'<a href="{p}"{here if p == path else ""}>{t}</a>' for p, t in PAGES)
    script = (
        '<script src="/console/static/uPlot.iife.min.js"></script>'
        '<script src="/console/static/console.js"></script>'
        if poll
        else ""
    )
    return (
        '<!doctype html><html><head><meta charset="utf-8">'
        f"<title>kvgate console: {html.escape(title)}</title>"
        '<link rel="stylesheet" href="/console/static/uPlot.min.css">'
        '<link rel="stylesheet" href="/console/static/console.css"></head>'
        f'<body data-page="{html.escape(path)}"><header><strong>kvgate</strong><nav>{nav}</nav>'
        '<span id="updated"></span></header>'
        f"<main><h1>{html.escape(title)}</h1>{body}</main>{script}</body></html>"
    )
