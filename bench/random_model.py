"""A random-weight Llama-shaped checkpoint for speed work: cost depends on shapes, not weights."""

import argparse
import shutil
from pathlib import Path


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tokenizer-dir", required=True, help="folder whose tokenizer files are copied")
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--intermediate", type=int, default=8192)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--vocab-size", type=int, default=49152)
    p.add_argument("--max-len", type=int, default=32768)
    p.add_argument("--init-device", default="cpu", help="where the random weights are drawn (cuda: seconds for 8B)")


def make_model(args, root: Path) -> Path:
    """Save a bf16 Llama (Llama-3.2-1B-like by default) plus the tokenizer into `root`."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    cfg = LlamaConfig(
        vocab_size=args.vocab_size,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        head_dim=args.head_dim,
        max_position_embeddings=args.max_len,
        tie_word_embeddings=True,
    )
    with torch.device(args.init_device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    model.save_pretrained(root)
    for f in Path(args.tokenizer_dir).iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "chat_template")):
            shutil.copy(f, root / f.name)
    return root


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__)
    add_args(p)
    p.add_argument("out")
    args = p.parse_args(argv)
    print(make_model(args, Path(args.out)))


if __name__ == "__main__":
    main()
