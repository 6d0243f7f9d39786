"""A test-only `kvgate worker` that dies in the middle of a NIXL transfer.

`python -m tests.nixl_fault_worker <worker flags>` serves as `kvgate worker` does, except that it
is SIGKILLed at one step of a NIXL transfer, named by $KVGATE_TEST_NIXL_DIE:
  write   as the prefill side, once its WRITE into the blocks the decode worker granted is
          posted (its bytes may be landing): the decode side holds blocks for a transfer that
          never commits;
  commit  as the decode side, when the commit comes: the prefill side wrote into a cache that is
          gone and gets no answer.
"""

import os
import signal
import sys

from workers import cli
from workers.nixl_agent import NixlAgent
from workers.transfer_nixl import NixlTransfer

DIE_ENV = "KVGATE_TEST_NIXL_DIE"


def _die(*args, **kwargs):
    os.kill(os.getpid(), signal.SIGKILL)


class _DiesOncePosted:
    """A NIXL agent whose process dies right after it posts a transfer."""

    def __init__(self, agent):
        self._agent = agent

    def __getattr__(self, name: str):
        return getattr(self._agent, name)

    def transfer(self, handle):
        self._agent.transfer(handle)
        _die()


def _write_and_die(self: NixlAgent, *args, **kwargs):
    self.agent = _DiesOncePosted(self.agent)
    return _WRITE(self, *args, **kwargs)


_WRITE = NixlAgent.write


def main(argv: list[str]) -> None:
    step = os.environ.get(DIE_ENV)
    if step == "write":
        NixlAgent.write = _write_and_die
    elif step == "commit":
        NixlTransfer.commit_endpoint = _die
    else:
        raise SystemExit(f"${DIE_ENV} must be write or commit, not {step!r}")
    args = cli.parser().parse_args(argv)
    cli.check_args(args)
    cli.serve(args, cli.build_server(args))


if __name__ == "__main__":
    main(sys.argv[1:])
