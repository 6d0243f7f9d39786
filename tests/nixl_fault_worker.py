"""A test-only `kvgate worker` that dies in the middle of a NIXL transfer.

`python -m tests.nixl_fault_worker <worker flags>` serves as `kvgate worker` does, except that
as a prefill worker it is SIGKILLed right after the decode worker granted its reservation,
before its WRITE completes: the decode side holds blocks for a transfer that never commits.
"""
import os
import signal
import sys

from workers import cli
from workers.transfer_nixl import NixlAgent


def _die(*args, **kwargs):
    os.kill(os.getpid(), signal.SIGKILL)


def main(argv: list[str]) -> None:
    NixlAgent.write = _die
    args = cli.parser().parse_args(argv)
    cli.check_args(args)
    cli.serve(args, cli.build_server(args))


if __name__ == "__main__":
    main(sys.argv[1:])
