"""The `kvgate` command: subcommands are looked up by name and imported only when used.

The table names modules rather than importing them so that `kvgate gateway` never loads
torch (the worker's executor) and `kvgate worker` never loads the gateway.
"""

import importlib
import sys
from importlib.metadata import PackageNotFoundError, version

COMMANDS = {
    "worker": ("workers.cli", "serve one model from a paged KV cache (OpenAI API)"),
    "gateway": ("gateway.server", "KV-aware gateway in front of a worker fleet"),
    "bridge": ("gateway.bridge", "publish a vLLM server's KV residency and load into Redis"),
    "bench": ("bench.loadgen", "load generator: `kvgate bench serve ...`"),
    "simulate": ("bench.simulate", "fleet simulator in virtual time"),
    "calibrate": ("bench.calibrate_cli", "measure a worker and write a sim cost profile"),
    "demo": ("gateway.demo", "gateway + local fleet + a short chat, printed"),
}


# The argparse parser of each command, by the words that run it (`kvgate bench serve`).
PARSERS = {
    "worker": "workers.cli",
    "gateway": "gateway.server",
    "bridge": "gateway.bridge",
    "bench serve": "bench.loadgen",
    "simulate": "bench.simulate",
    "calibrate": "bench.calibrate_cli",
    "demo": "gateway.demo",
}


def parser_of(command: str):
    """`kvgate COMMAND`'s argparse parser (for --help references and their tests)."""
    return importlib.import_module(PARSERS[command]).parser()


def kvgate_version() -> str:
    try:
        return version("kvgate")
    except PackageNotFoundError:  # run from a checkout that was never installed
        return "unknown (not installed)"


def usage() -> str:
    lines = ["usage: kvgate COMMAND [ARGS]   (kvgate COMMAND --help for its flags; kvgate --version)", "", "commands:"]
    lines += [f"  {name:<10} {doc}" for name, (_, doc) in COMMANDS.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    """Run a subcommand. No command or --help: the list, exit 0; --version: the version;
    an unknown command: one line naming the known ones, exit 2 (a usage error)."""
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        sys.exit(0)
    if argv[0] in ("-V", "--version"):
        print(f"kvgate {kvgate_version()}")
        sys.exit(0)
    if argv[0] not in COMMANDS:
        print(
            f"kvgate: unknown command {argv[0]!r} (commands: {', '.join(COMMANDS)}; see kvgate --help)", file=sys.stderr
        )
        sys.exit(2)
    module = importlib.import_module(COMMANDS[argv[0]][0])
    module.main(argv[1:])


if __name__ == "__main__":
    main()
