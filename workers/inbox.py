"""The engine's inbox: what other threads ask of the engine thread, run between its steps."""

from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass

from workers.outputs import RequestOutput
from workers.sampling_params import SamplingParams


@dataclass(slots=True)
class Add:
    """Inbox command: admit a request (`Engine.submit` says what the fields mean)."""

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    sink: Callable[[RequestOutput], None]
    detokenize: bool = True
    kv_wait_s: float = 0.0
    export: Callable | None = None
    cache_salt: str | None = None
    trace: bool = False


@dataclass(slots=True)
class Abort:
    """Inbox command: drop a request wherever it is and answer it with finish_reason "abort"."""

    request_id: str


@dataclass(slots=True)
class Call:
    """Inbox command: run `fn` on the engine thread between steps; its result goes to `future`."""

    fn: Callable[[], object]
    future: Future


Command = Add | Abort | Call
