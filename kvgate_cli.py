"""The `kvgate` command: one small module that dispatches to gateway and loadgen commands.

Only the chosen subcommand's module is imported (to add its arguments, then to run it), so
`kvgate engine` never loads the gateway and `kvgate serve` never loads loadgen.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from typing import Any, NamedTuple


class Command(NamedTuple):
    help: str
    module: str
    add_arguments: str
    run: str


COMMANDS: dict[str, Command] = {
    "serve": Command("run the gateway", "gateway.server.cli", "add_serve_arguments", "run_serve"),
    "engine": Command(
        "run a simulated vLLM engine replica",
        "loadgen.engine.server",
        "add_engine_arguments",
        "serve_engine",
    ),
    "demo": Command(
        "engines + gateway + the agent working day once per policy (make run)",
        "loadgen.demo",
        "add_demo_arguments",
        "run_demo",
    ),
    "tenants": Command(
        "add, list or revoke tenants and keys in a tenants file",
        "gateway.tenancy.cli",
        "add_tenants_arguments",
        "run_tenants",
    ),
    "billing": Command(
        "prompt-cache billing: simulate a workload, export or sum the ledger",
        "gateway.billing.cli",
        "add_billing_arguments",
        "run_billing",
    ),
    "audit": Command(
        "the Gu et al. timing audit of cache isolation between tenants",
        "loadgen.audit.probes",
        "add_audit_arguments",
        "run_audit_command",
    ),
    "audit-demo": Command(
        "the audit through kvgate (PASS) and at a bare engine (FAIL): make audit",
        "loadgen.audit.demo",
        "add_audit_demo_arguments",
        "run_audit_demo",
    ),
    "replay": Command(
        "replay a trace open-loop through any OpenAI-compatible URL, measured",
        "loadgen.replay",
        "add_replay_arguments",
        "run_replay_command",
    ),
    "sim": Command(
        "simulate a trace through the router in virtual time (every policy)",
        "loadgen.sim",
        "add_sim_arguments",
        "run_sim",
    ),
    "bench": Command(
        "kvgate vs sglang-router vs vllm-router on the same engines and trace",
        "loadgen.bench.peers",
        "add_bench_arguments",
        "run_bench",
    ),
    "bench-cpu": Command(
        "the gateway's CPU time per proxied request (a benchmark)",
        "loadgen.bench.cpu",
        "add_bench_cpu_arguments",
        "run_bench_cpu",
    ),
    "bench-keying": Command(
        "precise keying's CPU against approximate's, in process: chats, long prompts (a benchmark)",
        "loadgen.bench.keying",
        "add_bench_keying_arguments",
        "run_bench_keying",
    ),
    "bench-idle": Command(
        "an idle gateway's CPU on probes and scrapes with 4, 16, 64 replicas (a benchmark)",
        "loadgen.bench.idle",
        "add_bench_idle_arguments",
        "run_bench_idle",
    ),
    "bench-engine": Command(
        "the simulated engine's CPU time per request, KV events off and on (a benchmark)",
        "loadgen.bench.engine_cpu",
        "add_bench_engine_arguments",
        "run_bench_engine",
    ),
    "bench-directory": Command(
        "the Redis directory: lookup latency/throughput, memory (a benchmark)",
        "loadgen.bench.directory",
        "add_bench_directory_arguments",
        "run_bench_directory",
    ),
    "bench-adapters": Command(
        "LoRA adapters: residency routing against round robin and the peers (a benchmark)",
        "loadgen.bench.adapters",
        "add_bench_adapters_arguments",
        "run_bench_adapters",
    ),
    "bench-scale": Command(
        "the shared directory's Redis: CPU per routed request, what one Redis and a cluster "
        "carry (a benchmark)",
        "loadgen.bench.scale",
        "add_bench_scale_arguments",
        "run_bench_scale",
    ),
    "bench-fairness": Command(
        "fair flow control: the noisy neighbour, flow control off and on (a benchmark)",
        "loadgen.bench.fairness",
        "add_bench_fairness_arguments",
        "run_bench_fairness",
    ),
    "bench-pd": Command(
        "a prefill/decode fleet: kvgate against vllm-router's P/D mode (a benchmark)",
        "loadgen.bench.pd",
        "add_bench_pd_arguments",
        "run_bench_pd",
    ),
    "bench-fanout": Command(
        "fan-out holding and hot-prefix overflow, live (a benchmark)",
        "loadgen.bench.fanout",
        "add_bench_fanout_arguments",
        "run_bench_fanout",
    ),
    "bench-redis-reset": Command(
        "Redis killed and back empty under conversations: the hit-ratio dip (a benchmark)",
        "loadgen.bench.redis_reset",
        "add_bench_redis_reset_arguments",
        "run_bench_redis_reset",
    ),
    "bench-billing": Command(
        "the gateway's CPU per request without and with billing (a benchmark)",
        "loadgen.bench.billing",
        "add_bench_billing_arguments",
        "run_bench_billing",
    ),
    "bench-report": Command(
        "docs/benchmarks.md's headline table from docs/benchmarks.json (--check: drift)",
        "loadgen.bench.report",
        "add_bench_report_arguments",
        "run_bench_report",
    ),
    "footprint": Command(
        "the memory of the gateway's bounded in-process stores, filled past them (JSON)",
        "gateway.server.footprint",
        "add_footprint_arguments",
        "run_footprint",
    ),
    "chaos": Command(
        "the chaos suite: faults injected into real processes, each goal measured",
        "loadgen.chaos.runner",
        "add_chaos_arguments",
        "run_chaos",
    ),
}


class HelpFormatter(argparse.HelpFormatter):
    """argparse's ArgumentDefaultsHelpFormatter, minus "(default: None)" and "(default: False)"
    where an option's absence says it, and minus a second default where the help gives one."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if (
            "default" in text
            or default is None
            or default is False
            or default == []
            or default is argparse.SUPPRESS
            or not action.option_strings
        ):
            return text
        return f"{text} (default: %(default)s)"


class Parser(argparse.ArgumentParser):
    """Every parser and sub-parser (`kvgate billing export`) shows its options' defaults."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)


def build_parser(chosen: str | None) -> Parser:
    """The `kvgate` parser; only the `chosen` subcommand's module is imported, for its options."""
    parser = Parser(prog="kvgate", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, command in COMMANDS.items():
        sub = commands.add_parser(name, help=command.help, description=command.help)
        if name == chosen:
            getattr(importlib.import_module(command.module), command.add_arguments)(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser(next((a for a in argv if not a.startswith("-")), None))
    args = parser.parse_args(argv)
    args.argv = list(argv)  # reports print the command that made them
    command = COMMANDS[args.command]
    result = getattr(importlib.import_module(command.module), command.run)(args)
    return int(result or 0)


if __name__ == "__main__":
    sys.exit(main())
