"""Per-request sampling parameters: plain data, validated once at the API edge."""

import math
import reprlib
from array import array
from bisect import bisect_right
from dataclasses import dataclass, field

MAX_INT32 = 2**31 - 1
MAX_STOP = 32  # stop strings are matched on every token: bounded count and length
MAX_STOP_CHARS = 1024
MAX_STOP_TOKEN_IDS = 1024
MAX_LOGIT_BIAS = 1024  # vLLM's GPU runner's MAX_NUM_LOGIT_BIAS_TOKENS; OpenAI's map is a few hundred
LOGIT_BIAS_LIMIT = 100.0  # biases are clamped to [-100, 100], as vLLM clamps them
MAX_PENALTY = 2.0  # presence_penalty and frequency_penalty lie in [-2, 2] (OpenAI, vLLM)
MAX_ALLOWED_TOKEN_IDS = 1024  # vLLM's GPU runner's MAX_NUM_ALLOWED_TOKEN_IDS
MAX_BAD_WORDS = 128  # token sequences, with and without a leading space: vLLM's VLLM_MAX_NUM_BAD_WORDS
MAX_BAD_WORD_TOKENS = 1024  # their tokens in all: vLLM's VLLM_MAX_BAD_WORDS_TOTAL_TOKENS
_SHOWN = reprlib.Repr()  # a client's list echoed in an error as Python shows it, bounded (~20 kB)
_SHOWN.maxlist, _SHOWN.maxstring = 2 * MAX_BAD_WORDS, 80


class InvalidRequest(ValueError):
    """A client error: the server turns it into an OpenAI-shaped 400."""

    def __init__(self, message: str, param: str | None = None, code: str = "invalid_request"):
        super().__init__(message)
        self.param = param
        self.code = code


@dataclass(frozen=True)
class BannedSequences:
    """bad_words' token sequences as a step reads them (workers/logits_processors.py): each bans
    its last token where the output so far ends with its prefix (the tokens before the last).
    Sorted by prefix length, so those an output of n tokens can complete are the first
    `usable(n)`, and a step takes leading slices of arrays built once."""

    lengths: array  # each sequence's prefix length, ascending
    ends: array  # ends[k]: how many prefix tokens the first k sequences hold
    prefix: array  # the prefixes' tokens, sequence after sequence
    back: array  # each prefix token's distance from its sequence's end (prefix length - position)
    last: array  # each sequence's last token: the one banned

    @classmethod
    def of(cls, sequences: tuple[tuple[int, ...], ...]) -> "BannedSequences":
        ordered = sorted(sequences, key=len)
        ends = array("q", [0])
        prefix, back = array("q"), array("q")
        for seq in ordered:
            prefix.extend(seq[:-1])
            back.extend(range(len(seq) - 1, 0, -1))
            ends.append(len(prefix))
        return cls(array("q", [len(s) - 1 for s in ordered]), ends, prefix, back, array("q", [s[-1] for s in ordered]))

    def usable(self, num_output: int) -> int:
        """How many sequences (the first) an output of `num_output` tokens can end with its
        next: a prefix no longer than the output, which vLLM matches against the output only."""
        return bisect_right(self.lengths, num_output)


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
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_p: float = 0.0
    min_tokens: int = 0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias) pairs, ids distinct
    # how the answer's text is made (workers/detokenizer.py): the stop string kept at its end,
    # special tokens kept, and no space put between two added tokens where they are kept
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    allowed_token_ids: tuple[int, ...] | None = None  # only these may be sampled (None: any)
    bad_words: tuple[str, ...] = ()  # distinct, as sent
    # bad_words as token sequences (workers/protocol.py's `bad_words_token_ids`, which bounds them)
    bad_words_token_ids: tuple[tuple[int, ...], ...] = ()
    extra: dict = field(default_factory=dict, compare=False)
    # logit_bias' ids and biases and the distinct stop_token_ids as arrays, which the sampler
    # extends its step's data from (workers/logits_processors.py): built once, with the params
    logit_bias_ids: array = field(init=False, repr=False, compare=False)
    logit_bias_values: array = field(init=False, repr=False, compare=False)
    stop_id_array: array = field(init=False, repr=False, compare=False)
    stop_id_set: frozenset = field(init=False, repr=False, compare=False)  # a token's stop check, O(1)
    allowed_id_array: array = field(init=False, repr=False, compare=False)
    banned: BannedSequences = field(init=False, repr=False, compare=False)
    # `processes_logits`' terms, asked of every running row every step: whether a control applies
    # at every step, and the first output index a bad word can apply at (none: past any)
    always_processed: bool = field(init=False, repr=False, compare=False)
    banned_from: int = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        """The arrays, of the ids in range only: `validate` refuses params with any other."""
        bias = [(t, b) for t, b in self.logit_bias if 0 <= t <= MAX_INT32]
        object.__setattr__(self, "logit_bias_ids", array("q", [t for t, _ in bias]))
        object.__setattr__(self, "logit_bias_values", array("f", [b for _, b in bias]))
        stops = dict.fromkeys(t for t in self.stop_token_ids if 0 <= t <= MAX_INT32)
        object.__setattr__(self, "stop_id_array", array("q", stops))
        object.__setattr__(self, "stop_id_set", frozenset(self.stop_token_ids))
        allowed = [t for t in self.allowed_token_ids or () if 0 <= t <= MAX_INT32]
        object.__setattr__(self, "allowed_id_array", array("q", allowed))
        object.__setattr__(self, "banned", BannedSequences.of(self.bad_words_token_ids))
        always = self.penalized or bool(self.logit_bias) or self.allowed_token_ids is not None
        object.__setattr__(self, "always_processed", always)
        object.__setattr__(self, "banned_from", self.banned.lengths[0] if self.banned.lengths else 2**63)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    @property
    def penalized(self) -> bool:
        """Whether a penalty applies (each reads the sequence's tokens)."""
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    @property
    def reads_history(self) -> bool:
        """Whether a control reads the sequence's tokens: a penalty, or a bad word's prefix."""
        return self.penalized or (bool(self.banned.lengths) and self.banned.lengths[-1] > 0)

    def processes_logits(self, output_index: int) -> bool:
        """Whether the logits of this request's next token (its `output_index`-th) are changed
        before sampling: a penalty, a logit bias, stop tokens held back by `min_tokens`, tokens
        outside `allowed_token_ids`, or a bad word the output so far can complete."""
        return self.always_processed or output_index < self.min_tokens or output_index >= self.banned_from

    def validate(self, vocab_size: int | None = None) -> "SamplingParams":
        """Check every field's range, so no value a client can send reaches the engine as an
        error there (a top_k of 10**309 once did: no tensor holds it); allowed_token_ids in
        the model's `vocab_size` where given, in vLLM's order of its checks."""
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
        self._validate_controls()
        self._validate_masks(vocab_size)
        return self

    def _validate_controls(self) -> None:
        """vLLM's ranges for penalties, min_p, min_tokens and logit_bias (`min_tokens` against
        `max_tokens` is the caller's: the budget may be known only after the prompt)."""
        for name in ("presence_penalty", "frequency_penalty"):
            if not -MAX_PENALTY <= getattr(self, name) <= MAX_PENALTY:
                raise InvalidRequest(f"{name} must be in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}]", name)
        if not (math.isfinite(self.repetition_penalty) and self.repetition_penalty > 0):
            raise InvalidRequest("repetition_penalty must be a finite number > 0", "repetition_penalty")
        if not 0 <= self.min_p <= 1:
            raise InvalidRequest("min_p must be in [0, 1]", "min_p")
        if not 0 <= self.min_tokens <= MAX_INT32:
            raise InvalidRequest(f"min_tokens must be an integer in [0, {MAX_INT32}]", "min_tokens")
        if len(self.logit_bias) > MAX_LOGIT_BIAS or not all(
            0 <= t <= MAX_INT32 and abs(b) <= LOGIT_BIAS_LIMIT for t, b in self.logit_bias
        ):
            raise InvalidRequest(
                f"logit_bias takes at most {MAX_LOGIT_BIAS} token ids in [0, {MAX_INT32}] with biases "
                f"in [-{LOGIT_BIAS_LIMIT:g}, {LOGIT_BIAS_LIMIT:g}]",
                "logit_bias",
            )

    def _validate_masks(self, vocab_size: int | None) -> None:
        """vLLM's rules for bad_words before they are tokenized and for allowed_token_ids (in the
        model's `vocab_size` where known)."""
        if not all(self.bad_words):
            shown = _SHOWN.repr(list(self.bad_words))
            raise InvalidRequest(f"bad_words cannot contain an empty string. Got bad_words={shown}", "bad_words")
        allowed = self.allowed_token_ids
        if allowed is None:
            return
        if not allowed:
            message = vllm_message("allowed_token_ids is not None and empty!", "allowed_token_ids", [])
            raise InvalidRequest(message, "allowed_token_ids")
        limit = MAX_INT32 + 1 if vocab_size is None else vocab_size
        if invalid := [t for t in allowed if not 0 <= t < limit]:
            message = vllm_message("allowed_token_ids contains out-of-vocab token id!", "allowed_token_ids", invalid)
            raise InvalidRequest(message, "allowed_token_ids")
        if len(allowed) > MAX_ALLOWED_TOKEN_IDS:
            raise InvalidRequest(
                f"Too many allowed token IDs: {len(allowed)}. The max size is {MAX_ALLOWED_TOKEN_IDS}.",
                "allowed_token_ids",
            )


def vllm_message(message: str, param: str, value: object) -> str:
    """vLLM's validation error as its 400 shows it: the message, then the parameter and the
    rejected value (as Python prints it; a client's long list cut short)."""
    return f"{message} (parameter={param}, value={_SHOWN.repr(value)})"
