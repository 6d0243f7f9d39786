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

from workers.sampling_params import MAX_INT32, InvalidRequest, SamplingParams

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
# What vLLM 0.32 (transformers 5.19) takes from a folder's config.json when it has no
# generation_config.json: transformers' model config keeps these of the generation fields.
FROM_MODEL_CONFIG = ("max_new_tokens", "min_p", "eos_token_id")


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
    generation config), "vllm" (none: OpenAI's defaults) or another folder's;
    `override` a JSON object of HF generation fields set over it. Raises ValueError naming what
    is wrong, so a bad file stops the worker at start rather than making every request that
    leaves a field out a 400."""
    config = {} if source == "vllm" else read_generation_config(model_dir, source)
    extra = _override(override)
    config.update(extra)
    values = {name: config[name] for name in SAMPLING_FIELDS if config.get(name) is not None}
    budget = config.get("max_new_tokens")
    if budget is not None:
        values["max_tokens"] = budget
        if source not in ("auto", "vllm") or "max_new_tokens" in extra:
            values["max_tokens_cap"] = budget
    return checked(values, f"--generation-config {source}" + (" with --override-generation-config" if extra else ""))


def read_generation_config(model_dir: str | Path, source: str = "auto") -> dict:
    """The generation config vLLM loads for `source`: the model folder's ("auto", and "vllm",
    whose EOS ids still count) or the named folder's generation_config.json; without one, the
    FROM_MODEL_CONFIG fields of that folder's config.json. A named folder holding neither is an
    error (vLLM would start without defaults: a mistyped path should not)."""
    folder = Path(model_dir) if source in ("auto", "vllm") else Path(source)
    if (folder / GENERATION_FILE).is_file():
        config = _object_file(folder / GENERATION_FILE)
    elif (folder / "config.json").is_file():
        model = _object_file(folder / "config.json")
        config = {k: model[k] for k in FROM_MODEL_CONFIG if model.get(k) is not None}
    elif source in ("auto", "vllm"):
        config = {}
    else:
        raise ValueError(f"{folder} holds no {GENERATION_FILE} (nor a config.json)")
    _eos_list(config.get("eos_token_id"), folder)
    return config


def eos_token_ids(config: dict, primary: int | None) -> tuple[int, ...]:
    """The ids that end a generation, as vLLM stops: the tokenizer's EOS (`primary`), then the
    generation config's `eos_token_id`(s) (Llama 3 instruct lists several there)."""
    ids = [] if primary is None else [primary]
    return tuple(dict.fromkeys(ids + _eos_list(config.get("eos_token_id"), None)))


def _eos_list(value: object, folder: Path | None) -> list[int]:
    """An `eos_token_id`: a token id, a list of them, or null."""
    values = value if isinstance(value, list) else [] if value is None else [value]
    ids = [t for t in values if type(t) is int and 0 <= t <= MAX_INT32]
    if len(ids) != len(values):
        raise ValueError(f"{folder}: eos_token_id must be a token id or a list of token ids, not {value!r}"[:300])
    return ids


def _object_file(path: Path) -> dict:
    """A JSON object file's contents; ValueError when it is not one."""
    try:
        config = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise ValueError(f"{path} is not readable JSON: {str(e)[:200]}") from None
    if not isinstance(config, dict):
        raise ValueError(f"{path} is not a JSON object")
    return config


def _override(text: str | None) -> dict:
    """--override-generation-config's JSON object."""
    if not text:
        return {}
    try:
        value = json.loads(text)
    except (json.JSONDecodeError, RecursionError) as e:
        raise ValueError(f"--override-generation-config is not JSON: {str(e)[:200]}") from None
    if not isinstance(value, dict):
        raise ValueError("--override-generation-config must be a JSON object")
    return value


def checked(values: dict, origin: str) -> GenerationDefaults:
    """Defaults whose every value a request could have sent: the same ranges, so a default never
    reaches the engine as a value it refuses from a client (nor a number past any range as an
    overflow, from a file or another process's state)."""
    for name, v in values.items():
        integer = name in ("top_k", "max_tokens", "max_tokens_cap")
        if isinstance(v, bool) or not isinstance(v, int if integer else (int, float)):
            raise ValueError(f"{origin}: {name} must be {'an integer' if integer else 'a number'}, not {v!r}"[:300])
        if not (abs(v) <= MAX_INT32 if isinstance(v, int) else math.isfinite(v)):
            raise ValueError(f"{origin}: {name} must be finite and at most {MAX_INT32} in size")
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
