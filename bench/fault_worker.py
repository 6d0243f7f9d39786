"""A test-only `kvgate worker` whose executor misbehaves on marked prompts.

`python -m bench.fault_worker <worker flags>` serves exactly as `kvgate worker` does, but a
step that prefills a prompt starting with one of the marker token ids below fails the way a
real executor can: it raises (a CUDA error, a bad sampling value), kills the engine thread, or
hangs for a while. Only a prompt's first chunk is looked at, so generated tokens never trip it.
"""

import sys
import time

from gateway.procs import Proc, free_port
from workers import cli
from workers.executors.batch import SeqChunk

RAISE = 4242  # the step raises RuntimeError
DIE = 4243  # the step raises SystemExit: the engine thread ends
FREEZE = 4244  # the step sleeps FREEZE_S seconds before running
FREEZE_S = 3.0


class FaultyExecutor:
    """Wraps a real executor; everything but `execute` is passed through."""

    def __init__(self, inner):
        self.inner = inner

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def execute(self, chunks: list[SeqChunk]) -> list[int | None]:
        tokens = {c.token_ids[0] for c in chunks if c.start_pos == 0}
        if RAISE in tokens:
            raise RuntimeError("injected executor fault")
        if DIE in tokens:
            raise SystemExit("injected engine death")
        if FREEZE in tokens:
            time.sleep(FREEZE_S)
        return self.inner.execute(chunks)


def start(name: str, model: str, log_dir: str | None = None, extra: tuple[str, ...] = ()) -> Proc:
    """Start a sim-executor fault worker `name` on a free port (not waited for): the one way the
    tests start it."""
    port = free_port()
    argv = [sys.executable, "-m", "bench.fault_worker", "--model", model, "--executor", "sim"]
    return Proc(name, [*argv, "--port", str(port), "--worker-id", name, *extra], port, log_dir)


def main(argv: list[str]) -> None:
    args = cli.parser().parse_args(argv)
    cli.check_args(args)
    server = cli.build_server(args)
    server.engine.executor = FaultyExecutor(server.engine.executor)
    cli.serve(args, server)


if __name__ == "__main__":
    main(sys.argv[1:])
