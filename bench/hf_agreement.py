"""Top-1 agreement of kvgate's engine with HF transformers on a real checkpoint.

The engine (on CUDA: Triton paged attention and decode CUDA graphs) generates greedy
continuations of chat prompts in one batch. HF then reads each prompt plus the engine's tokens
in one forward pass (teacher forcing), and a token agrees when it is HF's top-1 at its position.
Teacher forcing scores every token on the same context, so one early near-tie does not hide the
rest as a free-running comparison would. Where they disagree the report gives HF's margin
between its top-1 and the engine's token: in bf16, disagreements should be near-ties.

    python -m bench.hf_agreement --model smollm2-135m --device cuda --dtype bfloat16 \
        --hf-dtypes bfloat16,float32 --out bench/results/hf-agreement-smollm2-h200.json
"""

import argparse
import json
import sys
from pathlib import Path

from workers.chat_template import render_chat
from workers.config import EngineConfig
from workers.engine import Engine
from workers.model_store import load_tokenizer, resolve, served_name
from workers.sampling_params import SamplingParams

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about autumn leaves.",
    "Explain what a hash table is in two sentences.",
    "List three prime numbers greater than 50.",
    "Translate 'good morning' into Spanish and German.",
    "Why is the sky blue?",
    "Give me a short recipe for pancakes.",
    "What does HTTP stand for?",
    "Summarise the plot of Romeo and Juliet in one paragraph.",
    "How do I reverse a list in Python?",
    "Name the planets of the solar system in order.",
    "What is 17 times 23?",
    "Describe a cat to someone who has never seen one.",
    "What are the benefits of regular exercise?",
    "Write a limerick about a programmer.",
    "What is the difference between weather and climate?",
]


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="bfloat16", help="the engine's dtype")
    p.add_argument("--hf-dtypes", default="bfloat16,float32", help="HF references, comma-separated")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--prompts", type=int, default=len(PROMPTS))
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument("--out", default="bench/results/hf-agreement.json")
    return p


def engine_tokens(args, prompts: list[list[int]]) -> tuple[list[list[int]], dict]:
    """Greedy tokens from the engine, all prompts in one batch; and which path ran."""
    import torch

    from workers.executors.torch_runner import TorchRunner

    block = 16
    blocks = sum(-(-(len(p) + args.max_tokens) // block) for p in prompts) + 8
    runner = TorchRunner(
        str(resolve(args.model)),
        blocks,
        block,
        args.device,
        getattr(torch, args.dtype),
        enforce_eager=args.enforce_eager,
        max_num_seqs=len(prompts),
    )
    engine = Engine(runner, load_tokenizer(args.model), EngineConfig(served_name(args.model), block, blocks, 2048))
    out: dict[str, list[int]] = {f"p{i}": [] for i in range(len(prompts))}
    for i, ids in enumerate(prompts):
        engine.submit(
            f"p{i}",
            ids,
            SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True),
            lambda o: out[o.request_id].extend(o.token_ids),
            detokenize=False,
        )
    while engine.has_work():
        engine.step()
    path = {"kernels": runner.kernels, "cuda_graphs": runner.graphs is not None, "dtype": args.dtype}
    return [out[f"p{i}"] for i in range(len(prompts))], path


def hf_agreement(args, dtype: str, prompts: list[list[int]], ours: list[list[int]]) -> dict:
    """Teacher-forced top-1 agreement of HF in `dtype` with the engine's tokens."""
    import torch
    from transformers import AutoModelForCausalLM

    model = (
        AutoModelForCausalLM.from_pretrained(str(resolve(args.model)), dtype=getattr(torch, dtype))
        .to(args.device)
        .eval()
    )
    per_prompt, margins = [], []
    with torch.inference_mode():
        for prompt, toks in zip(prompts, ours):
            ids = torch.tensor([prompt + toks], device=args.device)
            logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float()
            mine = torch.tensor(toks, device=args.device)
            top = logits.argmax(-1)
            agree = top == mine
            per_prompt.append(
                {
                    "agree": int(agree.sum()),
                    "tokens": len(toks),
                    "first_disagreement": int((~agree).nonzero()[0]) if not bool(agree.all()) else None,
                }
            )
            gap = logits.gather(1, top[:, None])[:, 0] - logits.gather(1, mine[:, None])[:, 0]
            margins += [round(float(g), 4) for g in gap[~agree]]
    del model
    agree = sum(p["agree"] for p in per_prompt)
    total = sum(p["tokens"] for p in per_prompt)
    return {
        "hf_dtype": dtype,
        "agreement": agree / total,
        "agree": agree,
        "tokens": total,
        "prompts_all_agree": sum(p["first_disagreement"] is None for p in per_prompt),
        "disagreement_margins": sorted(margins),
        "per_prompt": per_prompt,
    }


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4))
    width = 0.8 / max(len(report["references"]), 1)
    for k, ref in enumerate(report["references"]):
        xs = [i + k * width for i in range(len(ref["per_prompt"]))]
        ax.bar(
            xs,
            [p["agree"] / p["tokens"] for p in ref["per_prompt"]],
            width,
            label=f"HF {ref['hf_dtype']}: {100 * ref['agreement']:.1f}%",
        )
    ax.set_xlabel("prompt")
    ax.set_ylabel("top-1 agreement (teacher-forced)")
    ax.set_ylim(0, 1.05)
    ax.set_title(f"{report['model']} on {report['device']}, engine {report['path']['dtype']}")
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path)


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    tok = load_tokenizer(args.model)
    prompts = [
        tok.encode(render_chat([{"role": "user", "content": t}], tok), add_special_tokens=False)
        for t in PROMPTS[: args.prompts]
    ]
    ours, path = engine_tokens(args, prompts)
    report = {
        "model": args.model,
        "device": args.device,
        "path": path,
        "max_tokens": args.max_tokens,
        "prompts": len(prompts),
        "references": [hf_agreement(args, d, prompts, ours) for d in args.hf_dtypes.split(",") if d],
        "command": "python -m bench.hf_agreement " + " ".join(sys.argv[1:] if argv is None else argv),
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1))
    plot(report, out.with_suffix(".png"))
    for ref in report["references"]:
        print(
            f"engine {path} vs HF {ref['hf_dtype']}: {ref['agree']}/{ref['tokens']} = "
            f"{100 * ref['agreement']:.2f}% top-1; {ref['prompts_all_agree']}/{len(prompts)} prompts "
            f"agree on every token; disagreement margins {ref['disagreement_margins'][:8]}"
        )


if __name__ == "__main__":
    main()
