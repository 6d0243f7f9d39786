"""Per-request sampling parameters: plain data, validated once at the API edge."""
from dataclasses import dataclass, field


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
    extra: dict = field(default_factory=dict, compare=False)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    def validate(self) -> "SamplingParams":
        if self.max_tokens < 1:
            raise InvalidRequest("max_tokens must be at least 1", "max_tokens")
        if self.temperature < 0:
            raise InvalidRequest("temperature must be non-negative", "temperature")
        if not 0 < self.top_p <= 1:
            raise InvalidRequest("top_p must be in (0, 1]", "top_p")
        if self.top_k < 0:
            raise InvalidRequest("top_k must be non-negative (0 disables it)", "top_k")
        return self
