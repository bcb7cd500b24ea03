"""`kvgate serve`: run the gateway."""

from __future__ import annotations

import argparse
import socket
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

import uvicorn

from gateway.observability.logs import configure_logging
from gateway.server.workers import refusal, shared_port_socket, supervise, worker_settings
from gateway.settings import Settings
from router.registry import POLICIES


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", help="interface to listen on")
    parser.add_argument("--port", type=int, help="HTTP port")
    parser.add_argument(
        "--metrics-port",
        type=int,
        help="the admin port: /metrics and the API documents (0: any free port)",
    )
    parser.add_argument(
        "--engine", action="append", dest="engines", metavar="URL", help="an engine replica URL"
    )
    parser.add_argument(
        "--decode-engine",
        action="append",
        dest="decode_engines",
        metavar="URL",
        help="a decode instance's URL (P/D: every --engine is then a prefill instance)",
    )
    parser.add_argument("--policy", choices=sorted(POLICIES), help="routing policy")
    parser.add_argument(
        "--tenant", action="append", dest="tenants", metavar="NAME:KEY", help="a tenant's key"
    )
    parser.add_argument("--config", type=Path, help="a YAML file of settings")
    parser.add_argument("--server-secret-file", type=Path, help="file holding the server secret")
    parser.add_argument(
        "--redis-url",
        help="Redis shared by the gateways (directory, rate limits): redis://, rediss://, unix://",
    )
    parser.add_argument(
        "--debug-headers",
        action="store_true",
        default=None,
        help="add x-kvgate-* routing headers to responses (operators only: leaks cache state)",
    )
    parser.add_argument("--log-level", help="debug, info, warning, error")
    parser.add_argument(
        "--log-format", choices=("plain", "json"), help="every log line as text or as JSON"
    )
    parser.add_argument(
        "--tenants-file",
        type=Path,
        help="tenants, policies and key hashes (YAML or .json; kvgate tenants), reloaded on change",
    )
    parser.add_argument(
        "--grpc-port", type=int, help="also serve gRPC (kvgate.v1.Gateway) on this port"
    )
    parser.add_argument(
        "--mode",
        choices=("standalone", "epp"),
        help="standalone: serve the API; epp: also pick endpoints for Envoy (ext-proc)",
    )
    parser.add_argument("--epp-port", type=int, help="the ext-proc port in epp mode")
    parser.add_argument(
        "--workers",
        type=int,
        help="gateway processes sharing the ports (N > 1 needs --redis-url; docs/operations.md)",
    )
    # -- Kubernetes discovery and tracing (issue 9; docs/operations.md) --
    parser.add_argument(
        "--discovery",
        choices=("static", "kubernetes"),
        help="static: the --engine list; kubernetes: also the engines' EndpointSlices",
    )
    parser.add_argument(
        "--label-selector",
        dest="discovery_label_selector",
        help="which EndpointSlices are engines, e.g. kubernetes.io/service-name=vllm",
    )
    parser.add_argument(
        "--namespace", dest="discovery_namespace", help="the engines' namespace (default: own)"
    )
    parser.add_argument(
        "--port-name", dest="discovery_port_name", help="the EndpointSlice port to use, by name"
    )
    parser.add_argument("--kubeconfig", type=Path, help="a kubeconfig (default: in-cluster)")
    parser.add_argument(
        "--otlp-endpoint", help="export traces over OTLP/HTTP, e.g. http://collector:4318/v1/traces"
    )
    # -- precise mode (issue 16; docs/precise.md) --
    parser.add_argument(
        "--tokenizer-dir",
        type=Path,
        help="precise mode: the model's tokenizer directory (the engines' tokenizer files)",
    )
    parser.add_argument(
        "--kv-events-port", type=int, help="each engine's KV events PUB port (rank r: port + r)"
    )
    parser.add_argument(
        "--kv-events-replay-port", type=int, help="each engine's KV events replay port"
    )
    show_settings_defaults(parser)


def show_settings_defaults(parser: argparse.ArgumentParser) -> None:
    """An option's default is its setting's (the option stays None so that a KVGATE_* variable or
    --config still applies when it is not given): --help says which that is."""
    for action in parser._actions:
        field = Settings.model_fields.get(action.dest)
        if field is None or not action.help or "default" in action.help:
            continue
        default = field.get_default(call_default_factory=True)
        if default not in (None, False, [], ""):
            action.help += f" (default: {default})"


def run_serve(args: argparse.Namespace) -> int:
    from pydantic import ValidationError

    from gateway.server.app import create_app
    from gateway.server.cyclic_gc import tune_collector
    from gateway.server.malloc import pin_mmap_threshold

    pin_mmap_threshold()  # before the stores grow: freed dict tables leave RSS (malloc.py)
    from gateway.settings import describe_errors, load_settings
    from gateway.tenancy.tenant_file import TenantFileError

    try:
        settings = load_settings(
            args.config,
            host=args.host,
            port=args.port,
            metrics_port=args.metrics_port,
            engines=args.engines,
            decode_engines=args.decode_engines,
            policy=args.policy,
            tenants=args.tenants,
            server_secret_file=args.server_secret_file,
            redis_url=args.redis_url,
            debug_headers=args.debug_headers,
            log_level=args.log_level,
            log_format=args.log_format,
            tenants_file=args.tenants_file,
            grpc_port=args.grpc_port,
            mode=args.mode,
            epp_port=args.epp_port,
            workers=args.workers,
            discovery=args.discovery,
            discovery_label_selector=args.discovery_label_selector,
            discovery_namespace=args.discovery_namespace,
            discovery_port_name=args.discovery_port_name,
            kubeconfig=args.kubeconfig,
            otlp_endpoint=args.otlp_endpoint,
            tokenizer_dir=args.tokenizer_dir,
            kv_events_port=args.kv_events_port,
            kv_events_replay_port=args.kv_events_replay_port,
        )
    except ValidationError as exc:
        print(f"kvgate serve: invalid settings:\n{describe_errors(exc)}")
        return 2
    configure_logging(settings.log_level, settings.log_format)
    if not settings.engines and settings.discovery == "static":
        print(
            "kvgate serve: no engines; pass --engine URL (repeatable), set KVGATE_ENGINES, "
            "or discover them with --discovery kubernetes --label-selector SELECTOR"
        )
        return 2
    if settings.worker_index is None and settings.workers > 1:
        reason = refusal(settings)
        if reason is not None:
            print(f"kvgate serve: {reason}")
            return 2
        return supervise(settings, sys.argv[1:])
    if settings.worker_index is not None:
        settings = worker_settings(settings)
    try:
        app = create_app(settings)
    except TenantFileError as exc:
        print(f"kvgate serve: {exc}")
        return 2
    config = server_config(app, settings)
    sockets = None
    if settings.worker_index is not None:
        sockets = [shared_port_socket(settings.host, settings.port)]
    tune_collector()  # the young generation above the requests in flight (cyclic_gc.py)
    DrainingServer(config, app.state.begin_drain).run(sockets)
    return 0


def server_config(app: Any, settings: Settings) -> uvicorn.Config:
    """uvicorn's configuration for the gateway's HTTP front end. The keep-alive is
    `client_keep_alive_s`, longer than the clients' own pool idle limits: a server that ends an
    idle connection first races the client's next request on it (the client, starved of CPU,
    has not yet read the server's FIN: "Server disconnected", the request lost;
    docs/reliability.md, "Nothing lost under CPU starvation")."""
    return uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        log_level=settings.log_level.lower(),
        log_config=None,  # uvicorn's loggers go through ours: one format
        access_log=False,
        loop="uvloop",
        http="httptools",
        proxy_headers=False,
        server_header=False,
        date_header=False,
        timeout_graceful_shutdown=max(1, round(settings.shutdown_grace_s)),
        # typed int by uvicorn, used as a `call_later` delay: a fraction of a second is kept
        timeout_keep_alive=cast(int, settings.client_keep_alive_s),
    )


class DrainingServer(uvicorn.Server):
    """uvicorn's server, telling the gateway when its graceful shutdown begins (SIGTERM): the
    gRPC front end stops taking RPCs as HTTP stops accepting connections, so both drain within
    the one grace (`shutdown_grace_s`, uvicorn's `timeout_graceful_shutdown`)."""

    def __init__(self, config: uvicorn.Config, begin_drain: Callable[[], None]) -> None:
        super().__init__(config)
        self.begin_drain = begin_drain

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        self.begin_drain()
        await super().shutdown(sockets)
