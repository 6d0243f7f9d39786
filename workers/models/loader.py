"""Build a model from an HF folder (config.json + safetensors, single file or sharded)."""

import json
from pathlib import Path

import torch
from safetensors import safe_open

from workers.models.llama import LlamaForCausalLM, ModelConfig

# Buffers some older checkpoints carry; we recompute them, so they are not weights to load.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def load_config(model_dir: str | Path) -> dict:
    return json.loads((Path(model_dir) / "config.json").read_text())


def default_dtype(device: torch.device | str) -> torch.dtype:
    """float32 on CPU (bf16 matmuls are slow there and fidelity tests want exactness), bf16 on GPU."""
    return torch.float32 if torch.device(device).type == "cpu" else torch.bfloat16


def load_model(
    model_dir: str | Path, cfg: ModelConfig, device: torch.device, dtype: torch.dtype, kernels: bool = False
) -> LlamaForCausalLM:
    """Construct on the meta device (no random init, no double allocation), then fill from disk."""
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg, kernels)
    model = model.to(dtype).to_empty(device=device).eval()
    load_weights(model, model_dir)
    return model


def safetensors_files(model_dir: str | Path) -> list[Path]:
    model_dir = Path(model_dir)
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [model_dir / name for name in names]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {model_dir}")
    return files


@torch.no_grad()
def load_weights(model: LlamaForCausalLM, model_dir: str | Path) -> None:
    """Copy every checkpoint tensor into the parameter of the same name, or into its rows of a
    packed parameter (q/k/v, gate/up); fail loudly on gaps: every row must be filled."""
    params = dict(model.named_parameters())
    rows_left = {name: p.shape[0] for name, p in params.items()}
    for path in safetensors_files(model_dir):
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for name in f.keys():
                if name.endswith(_IGNORED_SUFFIXES) or (name == "lm_head.weight" and model.lm_head is None):
                    continue
                target, start, rows = model.packed_shard(name) or (name, 0, None)
                if target not in params:
                    raise ValueError(f"{path.name}: unexpected weight {name!r}")
                dest = params[target] if rows is None else params[target].narrow(0, start, rows)
                tensor = f.get_tensor(name)
                if dest.shape != tensor.shape:
                    raise ValueError(
                        f"{path.name}: {name!r} has shape {tuple(tensor.shape)}, expected {tuple(dest.shape)}"
                    )
                dest.copy_(tensor)
                rows_left[target] -= dest.shape[0]
    missing = sorted(name for name, left in rows_left.items() if left)
    if missing:
        raise ValueError(f"weights missing from {model_dir}: {missing[:8]}")
