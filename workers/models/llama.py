"""Compact Llama-family decoder (Llama 2/3, Mistral, Qwen2, Qwen3) over the paged KV cache.

One implementation covers the family because the members differ only in switches read from the
HF config: q/k/v bias (Qwen2), per-head q/k RMSNorm (Qwen3), an explicit head_dim, RoPE scaling
(Llama 3), a sliding window (Mistral) and tied embeddings. Module and parameter names follow HF
so safetensors checkpoints load without renaming. Tokens are flat [T] across all sequences of a
step; the paged attention layer sorts out which token sees which.
"""

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from workers.attention import PagedAttention

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")


@dataclass(frozen=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool
    rope: dict
    sliding_windows: tuple[int | None, ...]

    @classmethod
    def from_hf(cls, hf: dict) -> "ModelConfig":
        """Read an HF config.json dict, accepting both the 4.x and 5.x spellings of RoPE."""
        model_type = hf["model_type"]
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"unsupported model_type {model_type!r}; supported: {SUPPORTED_MODEL_TYPES}")
        if hf.get("hidden_act", "silu") != "silu":
            raise ValueError(f"unsupported hidden_act {hf['hidden_act']!r}")
        heads = hf["num_attention_heads"]
        bias = bool(hf.get("attention_bias") or False)
        return cls(
            model_type=model_type,
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=hf.get("num_key_value_heads") or heads,
            head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
            max_position_embeddings=hf["max_position_embeddings"],
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            qkv_bias=bias or model_type == "qwen2",
            o_bias=bias and model_type != "qwen2",
            mlp_bias=bool(hf.get("mlp_bias") or False),
            qk_norm=model_type == "qwen3",
            rope=rope_parameters(hf),
            sliding_windows=sliding_windows(hf),
        )


def rope_parameters(hf: dict) -> dict:
    """transformers 5.x writes `rope_parameters`; older configs `rope_theta` + `rope_scaling`."""
    params = dict(hf.get("rope_parameters") or {})
    if not params:
        params = {"rope_theta": hf.get("rope_theta", 10000.0), **(hf.get("rope_scaling") or {})}
    params["rope_type"] = params.get("rope_type", params.get("type", "default"))
    return params


def sliding_windows(hf: dict) -> tuple[int | None, ...]:
    """Per-layer window: `layer_types` names the windowed layers; without it (Mistral) all are."""
    window = hf.get("sliding_window")
    n = hf["num_hidden_layers"]
    if window is None or hf.get("use_sliding_window") is False:
        return (None,) * n
    types = hf.get("layer_types") or ["sliding_attention"] * n
    return tuple(window if t == "sliding_attention" else None for t in types)


def rope_inv_freq(rope: dict, head_dim: int) -> Tensor:
    """Inverse frequencies as HF computes them (float32), including Llama 3 and linear scaling."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim
    inv_freq = 1.0 / (rope["rope_theta"] ** exponents)
    kind = rope["rope_type"]
    if kind == "default":
        return inv_freq
    if kind == "linear":
        return inv_freq / rope["factor"]
    if kind == "llama3":
        return _llama3_inv_freq(inv_freq, rope)
    raise ValueError(f"unsupported rope_type {kind!r}; supported: default, linear, llama3")


def _llama3_inv_freq(inv_freq: Tensor, rope: dict) -> Tensor:
    """Llama 3.1 scaling: slow wavelengths divided by `factor`, a smooth ramp in between."""
    factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    old_len = rope["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(medium, smoothed, scaled)


class Rotary:
    """RoPE for the step's positions. Eager: cos/sin built once per step and shared by all
    layers. Kernels: a [max_pos, head_dim] cos|sin table (in the model's dtype, as HF rounds
    them) built once and read in place by the rotary kernel, so a step builds no tensors."""

    def __init__(self, inv_freq: Tensor, max_positions: int, kernels: bool):
        self.inv_freq = inv_freq
        self.max_positions = max_positions
        self.kernels = kernels
        self.cache: Tensor | None = None

    def prepare(self, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, ...]:
        """What every layer's `apply` needs for this step's positions."""
        if self.inv_freq.device != positions.device:
            # Kept out of the module's buffers so meta-device construction cannot clobber it.
            self.inv_freq = self.inv_freq.to(positions.device)
        if self.kernels:
            if self.cache is None or self.cache.dtype != dtype:
                from workers.kernels.rotary import rotary_cache

                self.cache = rotary_cache(self.inv_freq, self.max_positions, dtype, positions.device)
            return (positions,)
        emb = self._freqs(positions)
        return emb.cos().to(dtype)[:, None, :], emb.sin().to(dtype)[:, None, :]

    def apply(self, ctx: tuple[Tensor, ...], q: Tensor, k: Tensor) -> tuple[Tensor, Tensor]:
        if self.kernels:
            from workers.kernels.rotary import apply_rotary_inplace

            apply_rotary_inplace(q, k, ctx[0], self.cache)
            return q, k
        cos, sin = ctx
        return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)

    def _freqs(self, positions: Tensor) -> Tensor:
        freqs = positions[:, None].float() * self.inv_freq[None, :]
        return torch.cat((freqs, freqs), dim=-1)


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x [T, heads, hd]; the HF rotate-half convention, not interleaved pairs."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


class RMSNorm(nn.Module):
    """RMSNorm; given `residual`, first adds x into it and normalises the sum (vLLM's fused
    add-norm), returning (normed, residual): one kernel instead of three on the GPU."""

    def __init__(self, dim: int, eps: float, kernels: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.kernels = kernels

    def forward(self, x: Tensor, residual: Tensor | None = None):
        if self.kernels:
            from workers.kernels.norm import fused_add_rms_norm, rms_norm

            if residual is None:
                return rms_norm(x, self.weight, self.eps)
            fused_add_rms_norm(x, residual, self.weight, self.eps)
            return x, residual
        if residual is None:
            return self._norm(x)
        residual = x + residual
        return self._norm(residual), residual

    def _norm(self, x: Tensor) -> Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class LlamaAttention(nn.Module):
    """q, k and v come from one GEMM over the concatenated weights (`qkv_proj`); the loader
    fills its three row ranges from HF's q_proj/k_proj/v_proj."""

    def __init__(self, cfg: ModelConfig, layer: int, kernels: bool):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size, self.kv_size = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        self.qkv_proj = nn.Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=cfg.o_bias)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, kernels) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, kernels) if cfg.qk_norm else None
        self.attn = PagedAttention(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.sliding_windows[layer])

    def forward(self, x: Tensor, rotary: Rotary, rope: tuple[Tensor, ...], batch) -> Tensor:
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = rotary.apply(rope, q, k)
        return self.o_proj(self.attn(q, k, v, batch).flatten(1))


class LlamaMLP(nn.Module):
    """gate and up from one GEMM (`gate_up_proj`), then silu(gate) * up."""

    def __init__(self, cfg: ModelConfig, kernels: bool):
        super().__init__()
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)
        self.kernels = kernels

    def forward(self, x: Tensor) -> Tensor:
        gate_up = self.gate_up_proj(x)
        if self.kernels:
            from workers.kernels.activation import silu_and_mul

            return self.down_proj(silu_and_mul(gate_up))
        gate, up = gate_up.chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class LlamaDecoderLayer(nn.Module):
    """Pre-norm block carrying the residual stream beside the hidden state, so each norm can
    fold the preceding residual add into itself."""

    def __init__(self, cfg: ModelConfig, layer: int, kernels: bool):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, kernels)
        self.self_attn = LlamaAttention(cfg, layer, kernels)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, kernels)
        self.mlp = LlamaMLP(cfg, kernels)

    def forward(
        self, x: Tensor, residual: Tensor | None, rotary: Rotary, rope: tuple[Tensor, ...], batch
    ) -> tuple[Tensor, Tensor]:
        if residual is None:
            residual, x = x, self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(x, rotary, rope, batch)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelConfig, kernels: bool):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(cfg, i, kernels) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, kernels)


# HF weight name -> (our packed parameter, which of its row ranges): one GEMM for q/k/v and one
# for gate/up instead of five.
PACKED = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}


class LlamaForCausalLM(nn.Module):
    """`kernels`: run norms, activation and RoPE through workers.kernels (Triton, CUDA); off,
    plain torch ops, the reference the CPU runs."""

    def __init__(self, cfg: ModelConfig, kernels: bool = False):
        super().__init__()
        self.config = cfg
        self.model = LlamaModel(cfg, kernels)
        # Tied models read the embedding matrix directly instead of sharing a Parameter, so meta
        # construction and checkpoint loading need no re-tying.
        self.lm_head = None if cfg.tie_word_embeddings else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.rotary = Rotary(rope_inv_freq(cfg.rope, cfg.head_dim), cfg.max_position_embeddings, kernels)

    def forward(self, input_ids: Tensor, positions: Tensor, batch) -> Tensor:
        """Flat token ids and positions [T] -> final hidden states [T, hidden]."""
        x = self.model.embed_tokens(input_ids)
        rope = self.rotary.prepare(positions, x.dtype)
        residual = None
        for layer in self.model.layers:
            x, residual = layer(x, residual, self.rotary, rope, batch)
        x, _ = self.model.norm(x, residual)
        return x

    def packed_shard(self, name: str) -> tuple[str, int, int] | None:
        """For an HF weight that lives inside a packed parameter: (that parameter's name, first
        row, rows); None for weights stored as they are."""
        parts = name.split(".")
        if len(parts) < 2 or parts[-2] not in PACKED:
            return None
        packed, index = PACKED[parts[-2]]
        cfg = self.config
        q, kv, inter = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.intermediate_size
        sizes = [q, kv, kv] if packed == "qkv_proj" else [inter, inter]
        return ".".join(parts[:-2] + [packed, parts[-1]]), sum(sizes[:index]), sizes[index]

    def compute_logits(self, hidden: Tensor) -> Tensor:
        weight = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return F.linear(hidden, weight)

    def attention_layers(self) -> list[PagedAttention]:
        return [layer.self_attn.attn for layer in self.model.layers]
