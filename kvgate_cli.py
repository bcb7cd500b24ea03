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

    replay = commands.add_parser(
        "replay", help="replay a trace open-loop through any OpenAI-compatible URL, measured"
    )
    from loadgen.replay import add_replay_arguments

    add_replay_arguments(replay)

    sim = commands.add_parser(
        "sim", help="simulate a trace through the router in virtual time (every policy)"
    )
    from loadgen.sim import add_sim_arguments

    add_sim_arguments(sim)

    bench = commands.add_parser(
        "bench", help="kvgate vs sglang-router vs vllm-router on the same engines and trace"
    )
    from loadgen.bench import add_bench_arguments

    add_bench_arguments(bench)

    args = parser.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # reports print their command
    if args.command == "engine":
        from loadgen.engine import serve_engine

        serve_engine(args)
    elif args.command == "serve":
        from gateway.cli import run_serve

        return run_serve(args)
    elif args.command == "demo":
        from loadgen.demo import run_demo

        return run_demo(args)
    elif args.command == "bench-cpu":
        from loadgen.bench_cpu import run_bench_cpu

        return run_bench_cpu(args)
    elif args.command == "replay":
        from loadgen.replay import run_replay_command

        return run_replay_command(args)
    elif args.command == "sim":
        from loadgen.sim import run_sim

        return run_sim(args)
    elif args.command == "bench":
        from loadgen.bench import run_bench

        return run_bench(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
