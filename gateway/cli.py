"""The `kvgate` command: subcommands are looked up by name and imported only when used.

The table names modules rather than importing them so that `kvgate gateway` never loads
torch (the worker's executor) and `kvgate worker` never loads the gateway.
"""
import importlib
import sys

COMMANDS = {
    "worker": ("workers.cli", "serve one model from a paged KV cache (OpenAI API)"),
    "gateway": ("gateway.server", "KV-aware gateway in front of a worker fleet"),
    "bridge": ("gateway.bridge", "publish a vLLM server's KV residency and load into Redis"),
    "bench": ("bench.loadgen", "load generator: `kvgate bench serve ...`"),
    "simulate": ("bench.simulate", "fleet simulator in virtual time"),
    "calibrate": ("bench.calibrate", "measure a worker and write a sim cost profile"),
    "demo": ("gateway.demo", "gateway + local fleet + a short chat, printed"),
}


def usage() -> str:
    lines = ["usage: kvgate COMMAND [ARGS]", "", "commands:"]
    lines += [f"  {name:<10} {doc}" for name, (_, doc) in COMMANDS.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] not in COMMANDS:
        print(usage(), file=sys.stderr if argv else sys.stdout)
        sys.exit(2 if argv and argv[0] not in ("-h", "--help") else 0)
    module = importlib.import_module(COMMANDS[argv[0]][0])
    module.main(argv[1:])


if __name__ == "__main__":
    main()
