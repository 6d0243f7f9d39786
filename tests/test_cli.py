"""The `kvgate` command line tells the truth: every flag has help with its default, docs/cli.md
is the parsers' own --help, the README names only flags that exist, usage errors are one line
and exit 2, and a busy port fails before anything says "serving"."""

import argparse
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from gateway.cli import COMMANDS, PARSERS, parser_of
from gateway.cli_reference import reference

ROOT = Path(__file__).resolve().parent.parent
KVGATE = [sys.executable, "-m", "gateway.cli"]
SHOWN_WITHOUT_DEFAULT = (None, False, [], argparse.SUPPRESS)


def run(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([*KVGATE, *args], capture_output=True, text=True, timeout=timeout, cwd=ROOT)


def options(command: str) -> list[argparse.Action]:
    return [a for a in parser_of(command)._actions if a.option_strings and a.dest != "help"]


@pytest.mark.parametrize("command", PARSERS)
def test_every_flag_has_help_and_shows_its_default(command):
    text = "".join(parser_of(command).format_help().split())  # wrapping may split a long default
    for action in options(command):
        flag = action.option_strings[-1]
        assert action.help, f"kvgate {command} {flag} has no help"
        if action.default not in SHOWN_WITHOUT_DEFAULT and "default" not in action.help:
            assert f"(default:{action.default})".replace(" ", "") in text, f"kvgate {command} {flag} hides its default"


def test_docs_cli_md_is_the_parsers_help():
    assert (ROOT / "docs/cli.md").read_text() == reference(), "docs/cli.md is stale: make docs"


def readme_commands() -> list[tuple[str, str]]:
    """(command, its argument text) for every `kvgate COMMAND ...` in the README's code, with
    shell line continuations joined."""
    text = (ROOT / "README.md").read_text().replace("\\\n", " ").replace("\\|", "/")  # table cells escape |
    code = re.findall(r"```[a-z]*\n(.*?)```", text, re.S) + re.findall(r"`([^`\n]+)`", text)
    found = []
    for block in code:
        for m in re.finditer(r"kvgate (bench serve|[a-z]+)((?: +[^\s|;&#]+)*)", block):
            found.append((m.group(1), m.group(2)))
    return found


def test_the_readme_names_only_real_commands_and_flags():
    found = readme_commands()
    assert {c for c, _ in found} >= set(PARSERS), "every command appears in the README"
    for command, rest in found:
        if command == "bench":
            continue  # `kvgate bench serve` is matched whole above
        assert command in COMMANDS or command == "bench serve", f"README: no command kvgate {command}"
        flags = {s for a in parser_of(command)._actions for s in a.option_strings}
        for flag in re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]*)", rest):
            assert flag in flags, f"README: kvgate {command} has no {flag}"


def test_the_readme_points_only_inside_the_repository():
    text = (ROOT / "README.md").read_text()
    assert "/work/" not in text and "../shared" not in text
    for target in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", text):
        if not target.startswith(("http://", "https://")):
            assert (ROOT / target).exists(), f"README links to {target}, which is not in the repository"


def test_version():
    r = run("--version")
    assert r.returncode == 0 and re.fullmatch(r"kvgate \S+\n", r.stdout)


@pytest.mark.parametrize(
    "args,says",
    [
        (["frobnicate"], "unknown command 'frobnicate'"),
        (["bench", "frobnicate"], "usage: kvgate bench serve"),
        (
            ["simulate", "--policies", "frobnicate", "--rate", "1", "--out", "/tmp/never.json"],
            "unknown policy 'frobnicate'",
        ),
    ],
)
def test_usage_errors_are_one_line_and_exit_2(args, says):
    r = run(*args)
    assert r.returncode == 2 and r.stdout == ""
    assert says in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_an_unknown_gateway_policy_is_one_line_and_exit_2():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    r = run("gateway", "--port", str(port), "--worker", "http://127.0.0.1:9", "--policy", "frobnicate")
    assert r.returncode == 2 and r.stdout == "", r.stdout
    assert "unknown policy 'frobnicate'" in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr


@pytest.mark.parametrize(
    "command",
    [
        ["worker", "--model", "smollm2-135m", "--executor", "sim"],
        ["gateway", "--worker", "http://127.0.0.1:9"],
    ],
)
def test_a_busy_port_fails_before_serving(command):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        r = run(*command, "--port", str(port))
    assert r.returncode != 0 and "serving" not in r.stdout and " on http" not in r.stdout, r.stdout
    assert f"cannot listen on 127.0.0.1:{port}" in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
