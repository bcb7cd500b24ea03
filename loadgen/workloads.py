"""Workloads: agent traffic as sessions of dependent requests.

A `Session` is a list of steps; each step's prompt is the session's history plus new content,
and the history grows by the actual reply the gateway returned, as an agent's does. Sessions of
one `Phase` run in parallel; phases run one after another.

The agent working day (`agent_day`), ~30 requests:
- every request starts with the tenant's tools + system prompt (2,900 tokens);
- the main session opens with the project file (1,200 tokens) and runs 9 turns whose new content
  is 900 / 600 / 800 tokens in turn (instruction, tool result, diff);
- after turn 6, three subagents fan out in parallel, each with the system prompt, the project
  file and its own 400-token task, for 3 steps (each adds a 600-token tool result);
- a retry branch forks off turn 7: turns 8 and 9 again, with different content;
- the next day a new session in the same repository runs 9 more turns.

The team's day (`team_day`, `make run`): several developers' agent days at once, of several
tenants (each with its own key), phase by phase in parallel.

The 50-step agent session (`agent_session`):
- it starts at 12,000 tokens (tools, system prompt, project context, task: the rendered first
  prompt is exactly `start_tokens` engine tokens);
- each step appends the agent's reply (400 output tokens, generated) and a 1,100-token tool
  result, so step k's prompt is ~12,000 + 1,500·(k-1) tokens;
- optional long gaps: every `gap_every` steps the agent waits `gap_s` (a human reviewing, a
  long build) before the next step — long enough for a cache to forget the session;
- optional subagent fan-out: every `fanout_every` steps, `fanout` subagents start in parallel
  from the session's start (its first 12,000 tokens) plus their own task, and run
  `subagent_steps` steps each before the main session goes on.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from loadgen.engine.tokenizer import count_tokens, default_tokenizer
from loadgen.text import words

SYSTEM_TOKENS = 2_700
TOOLS_TOKENS = 200
PROJECT_FILE_TOKENS = 1_200
TURN_TOKENS = (900, 600, 800)
SUBAGENT_TASK_TOKENS = 400
SUBAGENT_STEP_TOKENS = 600


SESSION_STEPS = 50
SESSION_START_TOKENS = 12_000
SESSION_TOOL_TOKENS = 1_100
SESSION_OUTPUT_TOKENS = 400
SUBAGENT_TASK_TOKENS_SESSION = 300


@dataclass
class Step:
    """New messages appended to the session's history before this request."""

    messages: list[dict[str, Any]]
    label: str
    delay_s: float = 0.0
    """Wait this long (trace seconds) after the previous step before sending this one."""
    max_tokens: int | None = None
    """Output tokens to ask for; None: the runner's default."""


@dataclass
class Session:
    name: str
    prefix: list[dict[str, Any]]
    steps: list[Step]
    tools: list[dict[str, Any]] = field(default_factory=list)
    fork_of: str | None = None
    """A session that forks another starts from that session's history after `fork_at` steps."""
    fork_at: int = 0
    key: str | None = None
    """The API key its requests carry (its tenant's); None: the runner's."""


@dataclass
class Phase:
    name: str
    sessions: list[Session]


def _tools(tenant: str) -> list[dict[str, Any]]:
    names = ("read_file", "write_file", "run_tests", "search_code")
    per_tool = max(TOOLS_TOKENS // len(names) - 12, 1)
    return [
        {
            "type": "function",
            "function": {
                "name": name,
                "description": words(f"{tenant}/tool/{name}", per_tool).strip(),
                "parameters": {"type": "object", "properties": {"path": {"type": "string"}}},
            },
        }
        for name in names
    ]


def _system(tenant: str) -> dict[str, Any]:
    return {
        "role": "system",
        "content": "You are a coding agent." + words(f"{tenant}/system", SYSTEM_TOKENS),
    }


def _turn(session: str, i: int) -> dict[str, Any]:
    role = "user"
    return {"role": role, "content": words(f"{session}/turn{i}", TURN_TOKENS[i % len(TURN_TOKENS)])}


def agent_day(tenant: str = "acme", repo: str = "repo") -> list[Phase]:
    tools = _tools(tenant)
    system = _system(tenant)
    project = words(f"{tenant}/{repo}/project-file", PROJECT_FILE_TOKENS)

    def opening(session: str) -> dict[str, Any]:
        return {
            "role": "user",
            "content": "Project file:"
            + project
            + "\n\nTask:"
            + words(f"{session}/task", TURN_TOKENS[0]),
        }

    def main_steps(session: str, first: int, last: int) -> list[Step]:
        steps = []
        for i in range(first, last + 1):
            message = opening(session) if i == 1 else _turn(session, i)
            steps.append(Step([message], f"{session} turn {i}"))
        return steps

    main = Session("main", [system], main_steps("main", 1, 6), tools)
    subagents = [
        Session(
            f"subagent-{k}",
            [
                system,
                {
                    "role": "user",
                    "content": "Project file:"
                    + project
                    + "\n\nSubtask:"
                    + words(f"sub{k}/task", SUBAGENT_TASK_TOKENS),
                },
            ],
            [
                Step(
                    []
                    if j == 0
                    else [
                        {"role": "user", "content": words(f"sub{k}/step{j}", SUBAGENT_STEP_TOKENS)}
                    ],
                    f"subagent {k} step {j + 1}",
                )
                for j in range(3)
            ],
            tools,
        )
        for k in range(1, 4)
    ]
    main_rest = Session("main", [], main_steps("main", 7, 9), tools)
    retry = Session(
        "retry",
        [],
        [Step([_turn("retry", i)], f"retry of turn {i}") for i in (8, 9)],
        tools,
        fork_of="main",
        fork_at=7,
    )
    next_day = Session("next-day", [system], main_steps("next-day", 1, 9), tools)
    return [
        Phase("main session, turns 1-6", [main]),
        Phase("three subagents in parallel", subagents),
        Phase("main session, turns 7-9", [main_rest]),
        Phase("retry branch off turn 7", [retry]),
        Phase("next day, same repository", [next_day]),
    ]


def team_day(developers: Sequence[tuple[str, str, str | None]]) -> list[Phase]:
    """Several developers' agent working days at once, `(tenant, repo, API key)` each: phase i of
    every day runs in parallel with the others' phase i. A tenant's developers share its tools and
    system prompt (a hot spine under concurrent load); tenants have their own keys, so their
    caches are apart. `make run`'s workload."""
    days = []
    for tenant, repo, key in developers:
        day = agent_day(tenant, repo)
        for phase in day:
            for session in phase.sessions:
                session.name = f"{tenant}/{repo}/{session.name}"
                if session.fork_of is not None:
                    session.fork_of = f"{tenant}/{repo}/{session.fork_of}"
                session.key = key
        days.append(day)
    return [
        Phase(phases[0].name, [s for p in phases for s in p.sessions])
        for phases in zip(*days, strict=True)
    ]


def count_requests(phases: list[Phase]) -> int:
    return sum(max(len(s.steps), 1) for p in phases for s in p.sessions)


PLAN_TOKENS = 1_500


def agent_day_with_plan(tenant: str = "acme", repo: str = "repo") -> list[Phase]:
    """The agent day, but the three subagents share a plan the main agent has just written:
    system + project file + a 1,500-token plan (cached nowhere yet), then each one's 400-token
    task — the fan-out a held request turns from three writes of the plan into one."""
    phases = agent_day(tenant, repo)
    project = words(f"{tenant}/{repo}/project-file", PROJECT_FILE_TOKENS)
    plan = words(f"{tenant}/{repo}/plan", PLAN_TOKENS)
    system = _system(tenant)
    tools = _tools(tenant)
    phases[1] = Phase(
        "three subagents in parallel, sharing a fresh plan",
        [
            Session(
                f"subagent-{k}",
                [
                    system,
                    {
                        "role": "user",
                        "content": "Project file:"
                        + project
                        + "\n\nPlan:"
                        + plan
                        + "\n\nSubtask:"
                        + words(f"sub{k}/task", SUBAGENT_TASK_TOKENS),
                    },
                ],
                [
                    Step(
                        []
                        if j == 0
                        else [
                            {
                                "role": "user",
                                "content": words(f"sub{k}/step{j}", SUBAGENT_STEP_TOKENS),
                            }
                        ],
                        f"subagent {k} step {j + 1}",
                    )
                    for j in range(3)
                ],
                tools,
            )
            for k in range(1, 4)
        ],
    )
    return phases


def fanout_burst(
    num_subagents: int = 8, shared_tokens: int = 6_000, task_tokens: int = SUBAGENT_TASK_TOKENS
) -> list[Phase]:
    """A fresh job fans out at once: `num_subagents` requests sharing a context no replica holds
    yet (a new document and instructions), each with its own task, sent in parallel."""
    context = "Context:" + words("burst/context", shared_tokens)
    return [
        Phase(
            "a fresh fan-out",
            [
                Session(
                    f"burst-{k}",
                    [
                        {
                            "role": "user",
                            "content": context + "\n\nTask:" + words(f"burst{k}", task_tokens),
                        }
                    ],
                    [Step([], f"burst subagent {k}")],
                )
                for k in range(num_subagents)
            ],
        )
    ]


def _tool_result(seed: str, num_tokens: int) -> str:
    """A tool result of exactly `num_tokens` engine tokens ("Tool result:" and words)."""
    head = "Tool result:"
    return head + words(seed, max(num_tokens - count_tokens(head), 1))


def agent_session(
    *,
    steps: int = SESSION_STEPS,
    start_tokens: int = SESSION_START_TOKENS,
    tool_tokens: int = SESSION_TOOL_TOKENS,
    output_tokens: int = SESSION_OUTPUT_TOKENS,
    gap_every: int = 0,
    gap_s: float = 0.0,
    fanout_every: int = 0,
    fanout: int = 0,
    subagent_steps: int = 3,
    tenant: str = "acme",
    name: str = "session",
) -> list[Phase]:
    """The 50-step agent session (see the module docstring); phases alternate between runs of
    main-session steps and parallel subagent fan-outs."""
    if steps < 1 or start_tokens < 100 or tool_tokens < 1 or output_tokens < 1:
        raise ValueError("steps, tool_tokens and output_tokens must be >= 1, start >= 100")
    if gap_every < 0 or gap_s < 0 or fanout_every < 0 or fanout < 0 or subagent_steps < 1:
        raise ValueError("gaps and fan-out settings must be non-negative")
    tools = _tools(tenant)
    head = "You are a coding agent."
    fixed = [{"role": "system", "content": head}, {"role": "user", "content": "Task:"}]
    render_chat = default_tokenizer().render_chat  # the engine's chat template
    context_tokens = start_tokens - count_tokens(render_chat(fixed, tools))
    system_tokens = min(SYSTEM_TOKENS, context_tokens // 2)
    system = {"role": "system", "content": head + words(f"{tenant}/system", system_tokens)}
    for _ in range(3):  # the prefixes' own tokens ("Task:") are what the first guess misses
        task = {
            "role": "user",
            "content": "Task:" + words(f"{name}/context", context_tokens - system_tokens) + "\n",
        }
        error = count_tokens(render_chat([system, task], tools)) - start_tokens
        if error == 0:
            break
        context_tokens -= error
    start = [system, task]

    def main_step(k: int) -> Step:
        # step 1 is the start itself; step k > 1 adds a tool result after the agent's reply
        gap = gap_s if gap_every and k > 1 and (k - 1) % gap_every == 0 else 0.0
        messages = (
            []
            if k == 1
            else [
                {
                    "role": "user",
                    "content": _tool_result(f"{name}/tool{k}", tool_tokens),
                }
            ]
        )
        return Step(messages, f"{name} step {k}", delay_s=gap, max_tokens=output_tokens)

    phases: list[Phase] = []
    batch: list[Step] = []
    first = True
    for k in range(1, steps + 1):
        batch.append(main_step(k))
        if fanout_every and fanout and k % fanout_every == 0 and k < steps:
            phases.append(
                Phase(f"{name} steps", [Session(name, start if first else [], batch, tools)])
            )
            first = False
            batch = []
            phases.append(
                Phase(
                    f"{fanout} subagents after step {k}",
                    [
                        Session(
                            f"{name}/sub{k}-{j}",
                            [
                                *start,
                                {
                                    "role": "user",
                                    "content": "Subtask:"
                                    + words(
                                        f"{name}/sub{k}-{j}/task", SUBAGENT_TASK_TOKENS_SESSION
                                    ),
                                },
                            ],
                            [
                                Step(
                                    []
                                    if i == 0
                                    else [
                                        {
                                            "role": "user",
                                            "content": _tool_result(
                                                f"{name}/sub{k}-{j}/tool{i}", tool_tokens
                                            ),
                                        }
                                    ],
                                    f"{name} subagent {k}-{j} step {i + 1}",
                                    max_tokens=output_tokens,
                                )
                                for i in range(subagent_steps)
                            ],
                            tools,
                        )
                        for j in range(fanout)
                    ],
                )
            )
    if batch:
        phases.append(Phase(f"{name} steps", [Session(name, start if first else [], batch, tools)]))
    return phases
