"""Per-request sampling parameters: plain data, validated once at the API edge."""

import math
from dataclasses import dataclass, field

MAX_INT32 = 2**31 - 1
MAX_STOP = 32  # stop strings are matched on every token: bounded count and length
MAX_STOP_CHARS = 1024
MAX_STOP_TOKEN_IDS = 1024


class InvalidRequest(ValueError):
    """A client error: the server turns it into an OpenAI-shaped 400."""

    def __init__(self, message: str, param: str | None = None, code: str = "invalid_request"):
        super().__init__(message)
        self.param = param
        self.code = code


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # report the sampled token's log-probability and this many top ones
    extra: dict = field(default_factory=dict, compare=False)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    def validate(self) -> "SamplingParams":
        """Check every field's range, so no value a client can send reaches the engine as an
        error there (a top_k of 10**309 once did: no tensor holds it)."""
        if self.max_tokens < 1:
            raise InvalidRequest("max_tokens must be at least 1", "max_tokens")
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise InvalidRequest("temperature must be a finite number >= 0", "temperature")
        if not 0 < self.top_p <= 1:
            raise InvalidRequest("top_p must be in (0, 1]", "top_p")
        if not 0 <= self.top_k <= MAX_INT32:
            raise InvalidRequest(f"top_k must be -1 or 0 (disabled) or in [1, {MAX_INT32}]", "top_k")
        if self.seed is not None and not -(2**63) <= self.seed < 2**63:
            raise InvalidRequest("seed must be a 64-bit signed integer", "seed")
        if len(self.stop) > MAX_STOP or not all(0 < len(s) <= MAX_STOP_CHARS for s in self.stop):
            raise InvalidRequest(f"stop takes at most {MAX_STOP} strings of 1 to {MAX_STOP_CHARS} characters", "stop")
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS or not all(0 <= t <= MAX_INT32 for t in self.stop_token_ids):
            raise InvalidRequest(
                f"stop_token_ids takes at most {MAX_STOP_TOKEN_IDS} token ids in [0, {MAX_INT32}]", "stop_token_ids"
            )
        return self
