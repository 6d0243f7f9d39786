"""docs/cli.md: every command's `--help`, generated from argparse (`make docs` rewrites it,
tests/test_cli.py fails when it is stale), so the reference cannot drift from the flags."""

import os
import sys

from gateway.cli import PARSERS, parser_of

WIDTH = "100"  # help is wrapped to the terminal's width: fixed here so the file is the same everywhere


def reference() -> str:
    os.environ["COLUMNS"] = WIDTH
    parts = [
        "# Command reference\n",
        "Generated from the commands' argparse parsers by `make docs` (`python -m gateway.cli_reference > docs/cli.md`);",
        "`tests/test_cli.py` fails when it is out of date. `kvgate COMMAND --help` prints the same.\n",
    ]
    for command in PARSERS:
        parts += [f"## kvgate {command}\n", "```text", parser_of(command).format_help().rstrip(), "```\n"]
    return "\n".join(parts)


if __name__ == "__main__":
    sys.stdout.write(reference())
