"""The `kvgate` command: one small module that dispatches to gateway and loadgen commands.

Imports are deferred to the chosen subcommand, so `kvgate engine` never loads the gateway and
`kvgate serve` never loads loadgen.
"""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvgate", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    engine = commands.add_parser("engine", help="run a simulated vLLM engine replica")
    from loadgen.engine import add_engine_arguments

    add_engine_arguments(engine)

    serve = commands.add_parser("serve", help="run the gateway")
    from gateway.cli import add_serve_arguments

    add_serve_arguments(serve)

    demo = commands.add_parser(
        "demo", help="engines + gateway + the agent working day once per policy (make run)"
    )
    from loadgen.demo import add_demo_arguments

    add_demo_arguments(demo)

    bench_cpu = commands.add_parser(
        "bench-cpu", help="the gateway's CPU time per proxied request (a benchmark)"
    )
    from loadgen.bench_cpu import add_bench_cpu_arguments

    add_bench_cpu_arguments(bench_cpu)

    bench_directory = commands.add_parser(
        "bench-directory",
        help="the Redis directory: lookup latency/throughput, memory (a benchmark)",
    )
    from loadgen.bench_directory import add_bench_directory_arguments

    add_bench_directory_arguments(bench_directory)

    tenants = commands.add_parser(
        "tenants", help="add, list or revoke tenants and keys in a tenants file"
    )
    from gateway.tenants_cli import add_tenants_arguments

    add_tenants_arguments(tenants)

    audit = commands.add_parser(
        "audit", help="the Gu et al. timing audit of cache isolation between tenants"
    )
    from loadgen.audit import add_audit_arguments

    add_audit_arguments(audit)

    audit_demo = commands.add_parser(
        "audit-demo", help="the audit through kvgate (PASS) and at a bare engine (FAIL): make audit"
    )
    from loadgen.audit_demo import add_audit_demo_arguments

    add_audit_demo_arguments(audit_demo)

    bench_fanout = commands.add_parser(
        "bench-fanout", help="fan-out holding and hot-prefix overflow, live (a benchmark)"
    )
    from loadgen.bench_fanout import add_bench_fanout_arguments

    add_bench_fanout_arguments(bench_fanout)
    bench_billing = commands.add_parser(
        "bench-billing", help="the gateway's CPU per request without and with billing (a benchmark)"
    )
    from loadgen.bench_billing import add_bench_billing_arguments

    add_bench_billing_arguments(bench_billing)

    billing = commands.add_parser(
        "billing", help="prompt-cache billing: simulate a workload, export or sum the ledger"
    )
    from gateway.billing.cli import add_billing_arguments

    add_billing_arguments(billing)

    args = parser.parse_args(argv)
    if args.command == "engine":
        from loadgen.engine import serve_engine

        serve_engine(args)
    elif args.command == "serve":
        from gateway.cli import run_serve

        return run_serve(args)
    elif args.command == "demo":
        from loadgen.demo import run_demo

        return run_demo(args)
    elif args.command == "bench-directory":
        from loadgen.bench_directory import run_bench_directory

        return run_bench_directory(args)
    elif args.command == "bench-fanout":
        from loadgen.bench_fanout import run_bench_fanout

        return run_bench_fanout(args)
    elif args.command == "bench-billing":
        from loadgen.bench_billing import run_bench_billing

        return run_bench_billing(args)
    elif args.command == "billing":
        from gateway.billing.cli import run_billing

        return run_billing(args)
    elif args.command == "bench-cpu":
        from loadgen.bench_cpu import run_bench_cpu

        return run_bench_cpu(args)
    elif args.command == "tenants":
        from gateway.tenants_cli import run_tenants

        return run_tenants(args)
    elif args.command == "audit":
        from loadgen.audit import run_audit_command

        return run_audit_command(args)
    elif args.command == "audit-demo":
        from loadgen.audit_demo import run_audit_demo

        return run_audit_demo(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
