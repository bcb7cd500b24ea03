"""The README's commands work as written after its two set-up commands: every `sh` block after
the set-up one runs in bash (bounded), with `.venv` standing for the venv running the tests and
free ports in place of the fixed ones, so the suite fails the day a README command does."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import orjson

from gateway.settings import Settings
from loadgen.harness.processes import free_port

README = Path(__file__).resolve().parent.parent / "README.md"
SETUP = ["make run", "make test"]
BLOCK_TIMEOUT_S = 90.0
PORT = r"\b[89]\d{3}\b"


def shell_blocks(text: str) -> list[str]:
    return re.findall(r"```sh\n(.*?)```", text, flags=re.DOTALL)


def commands(block: str) -> list[str]:
    """A block's commands without their comments (continuation lines joined)."""
    joined = block.replace("\\\n", " ")
    return [
        line.split("#")[0].strip() for line in joined.splitlines() if line.split("#")[0].strip()
    ]


def with_free_ports(block: str) -> tuple[str, dict[str, str]]:
    """Each fixed port (8080, 8101, ...) in the block becomes one free port, everywhere; the
    gateway's default ports (a block relies on them without naming them) go to its environment."""
    ports = {port: str(free_port()) for port in set(re.findall(PORT, block))}
    env = {
        "KVGATE_PORT": ports.get(str(Settings.model_fields["port"].default), str(free_port())),
        "KVGATE_METRICS_PORT": str(free_port()),
    }
    return re.sub(PORT, lambda m: ports[m.group(0)], block), env


def test_the_readme_starts_with_exactly_the_two_set_up_commands() -> None:
    assert commands(shell_blocks(README.read_text())[0]) == SETUP


def test_every_readme_command_names_kvgate_by_its_venv_path() -> None:
    """`kvgate` is not on PATH after `make run`: a bare `kvgate` in a block fails as written."""
    for block in shell_blocks(README.read_text())[1:]:
        for command in commands(block):
            assert not re.match(r"kvgate\b", command), command


def run_block(block: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    """Run a block in bash; the output goes to files (a server the block left running would hold a
    pipe open), and the block's whole process group is killed at the end, whatever it left."""
    script, ports = with_free_ports(block)
    out, err = cwd / "stdout", cwd / "stderr"
    with out.open("w") as stdout, err.open("w") as stderr:
        proc = subprocess.Popen(
            ["bash", "-c", "set -eu\n" + script],
            cwd=cwd,
            env={**os.environ, **ports},
            stdout=stdout,
            stderr=stderr,
            start_new_session=True,
        )
        try:
            returncode = proc.wait(timeout=BLOCK_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            returncode = -1
        finally:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return subprocess.CompletedProcess(proc.args, returncode, out.read_text(), err.read_text())


def test_the_use_it_block_answers_a_chat_completion(tmp_path: Path) -> None:
    (tmp_path / ".venv").symlink_to(Path(sys.prefix))  # `.venv/bin/kvgate` is this venv's
    blocks = shell_blocks(README.read_text())[1:]
    use_it = next(b for b in blocks if "/v1/chat/completions" in b)
    done = run_block(use_it, tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    body = orjson.loads(done.stdout)
    assert body["object"] == "chat.completion"
    assert body["choices"][0]["message"]["content"]


def test_make_run_installs_only_the_runtime_set_and_make_test_adds_dev(tmp_path: Path) -> None:
    """`make run` is the first thing a newcomer types: it must not wait on the test tools."""
    root = README.parent

    def planned(target: str) -> str:
        return subprocess.run(
            ["make", "-n", target, f"VENV={tmp_path / 'venv'}"],
            cwd=root,
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        ).stdout

    run, test = planned("run"), planned("test")
    assert "install --quiet --disable-pip-version-check -e '.'" in run
    assert ".[dev]" not in run
    assert "-e '.[dev]'" in test
    for plan in (run, test):  # every install puts opentelemetry-proto's own files back
        assert plan.count("--force-reinstall") == plan.count(" -e '")
