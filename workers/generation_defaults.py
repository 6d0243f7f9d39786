"""A model's own sampling defaults: what a request's absent sampling fields take (vLLM's
`--generation-config` and `--override-generation-config`).

vLLM serves a model with the sampling fields its `generation_config.json` sets (Llama 3's
temperature 0.6 and top_p 0.9, say) wherever a request leaves them out, and kvgate's workers do
the same, so a client sees the same answers behind either. The rule for one field: the request's
value, else the model's default, else OpenAI's (temperature 1, top_p 1, no top_k, ...).
"""

import json
import math
from dataclasses import dataclass, fields
from pathlib import Path

from workers.sampling_params import InvalidRequest, SamplingParams

# the fields vLLM takes from a generation config (its ModelConfig.get_diff_sampling_param);
# HF's `max_new_tokens` is vLLM's `max_tokens`
SAMPLING_FIELDS = (
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "temperature",
    "top_k",
    "top_p",
    "min_p",
)
GENERATION_FILE = "generation_config.json"


@dataclass(frozen=True)
class GenerationDefaults:
    """Each field None where the model sets no default. `max_tokens` is a chat's budget when
    it asks for none; `max_tokens_cap` bounds every request's budget (vLLM's override_max_tokens:
    set only by a generation config named by path or by the override)."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    max_tokens: int | None = None
    max_tokens_cap: int | None = None

    def value(self, name: str, fallback: float | int) -> float | int:
        """The default of sampling field `name`: the model's, else `fallback` (OpenAI's)."""
        v = getattr(self, name)
        return fallback if v is None else v

    def to_json(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None}

    @classmethod
    def from_json(cls, d: dict) -> "GenerationDefaults":
        return checked({k: v for k, v in d.items() if k in {f.name for f in fields(cls)}}, "defaults")


NEUTRAL = GenerationDefaults()


def load_generation_defaults(
    model_dir: str | Path, source: str = "auto", override: str | None = None
) -> GenerationDefaults:
    """The defaults a worker serves `model_dir` with. `source`: "auto" (the model folder's
    generation_config.json), "vllm" (none: OpenAI's defaults) or a folder holding a
    generation_config.json; `override` a JSON object of HF generation fields set over it.
    Raises ValueError naming what is wrong, so a bad file stops the worker at start rather than
    making every request that leaves a field out a 400."""
    if source == "vllm":
        config: dict = {}
    else:
        config = _read(Path(model_dir) if source == "auto" else Path(source), required=source != "auto")
    extra = _override(override)
    config.update(extra)
    values = {name: config[name] for name in SAMPLING_FIELDS if config.get(name) is not None}
    budget = config.get("max_new_tokens")
    if budget is not None:
        values["max_tokens"] = budget
        if source not in ("auto", "vllm") or "max_new_tokens" in extra:
            values["max_tokens_cap"] = budget
    return checked(values, f"--generation-config {source}" + (" with --override-generation-config" if extra else ""))


def _read(folder: Path, required: bool) -> dict:
    """A folder's generation_config.json as a dict ({} when absent and not `required`)."""
    path = folder / GENERATION_FILE
    if not path.is_file():
        if required:
            raise ValueError(f"{folder} holds no {GENERATION_FILE}")
        return {}
    try:
        config = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path} is not readable JSON: {e}") from None
    if not isinstance(config, dict):
        raise ValueError(f"{path} is not a JSON object")
    return config


def _override(text: str | None) -> dict:
    """--override-generation-config's JSON object."""
    if not text:
        return {}
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"--override-generation-config is not JSON: {e}") from None
    if not isinstance(value, dict):
        raise ValueError("--override-generation-config must be a JSON object")
    return value


def checked(values: dict, origin: str) -> GenerationDefaults:
    """Defaults whose every value a request could have sent: the same ranges, so a default never
    reaches the engine as a value it refuses from a client."""
    for name, v in values.items():
        integer = name in ("top_k", "max_tokens", "max_tokens_cap")
        if isinstance(v, bool) or not isinstance(v, int if integer else (int, float)):
            raise ValueError(f"{origin}: {name} must be {'an integer' if integer else 'a number'}, not {v!r}")
        if not integer and not math.isfinite(v):
            raise ValueError(f"{origin}: {name} must be finite")
    if values.get("top_k") == -1:
        values["top_k"] = 0
    for name in ("max_tokens", "max_tokens_cap"):
        if values.get(name) is not None and values[name] < 1:
            raise ValueError(f"{origin}: max_new_tokens must be at least 1")
    try:
        SamplingParams(**{k: v for k, v in values.items() if k in SAMPLING_FIELDS}).validate()
    except InvalidRequest as e:
        raise ValueError(f"{origin}: {e}") from None
    return GenerationDefaults(**values)


def chat_budget(defaults: GenerationDefaults, context_left: int) -> int:
    """A chat's budget when it asks for none: the model's default, at most what its context leaves."""
    return context_left if defaults.max_tokens is None else min(defaults.max_tokens, context_left)


def capped(defaults: GenerationDefaults, budget: int) -> int:
    """A request's budget under the cap the operator set, if any."""
    return budget if defaults.max_tokens_cap is None else min(budget, defaults.max_tokens_cap)
