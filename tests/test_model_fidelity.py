"""Our paged model must generate exactly what HF generates, however the work is cut into steps.

Tiny random checkpoints cover the family's switches: GQA ratios, explicit head_dim, q/k/v bias,
q/k norm, Llama 3 / linear RoPE scaling (in both config spellings), sliding window, tied and
untied embeddings. Weights are re-randomised with a wide spread (biases and norms included) so
that greedy choices are decisive and every parameter matters.
"""

import json
import random

import pytest
import torch
import transformers

from workers.executors.batch import SeqChunk
from workers.executors.torch_runner import (
    BLOCK_BUCKET,
    SEQ_BUCKET,
    TOKEN_BUCKET,
    TorchRunner,
    blocks_that_fit,
    default_eos_ids,
)
from workers.sampling_params import SamplingParams

BLOCK = 4
NUM_BLOCKS = 96
NEW_TOKENS = 6
GREEDY = SamplingParams(temperature=0.0)
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}
SMALL = dict(vocab_size=512, num_hidden_layers=2, max_position_embeddings=256)

CONFIGS = {
    "llama3-gqa4-tied": transformers.LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=1,
        tie_word_embeddings=True,
        rope_scaling=LLAMA3_ROPE,
        **SMALL,
    ),
    "llama2-mha-linear-oldstyle": transformers.LlamaConfig(
        hidden_size=128,
        intermediate_size=256,
        num_attention_heads=8,
        num_key_value_heads=8,
        rope_scaling={"rope_type": "linear", "factor": 2.0},
        rope_theta=500.0,
        **SMALL,
    ),
    "qwen2-bias-gqa2": transformers.Qwen2Config(
        hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, **SMALL
    ),
    "qwen3-qknorm-headdim32-tied": transformers.Qwen3Config(
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        tie_word_embeddings=True,
        **SMALL,
    ),
    "mistral-window5": transformers.MistralConfig(
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        sliding_window=5,
        **SMALL,
    ),
}


def _randomize(model: torch.nn.Module) -> None:
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
            else:
                p.normal_(0.0, 0.3 if name.endswith("bias") else 0.15)


def _to_old_rope_spelling(path) -> None:
    """Rewrite config.json the way transformers 4.x wrote it: rope_theta + rope_scaling."""
    cfg = json.loads(path.read_text())
    rope = cfg.pop("rope_parameters")
    cfg["rope_theta"] = rope.pop("rope_theta")
    cfg["rope_scaling"] = {"type": rope.pop("rope_type"), **rope}
    path.write_text(json.dumps(cfg))


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    built = {}
    for i, (name, cfg) in enumerate(CONFIGS.items()):
        torch.manual_seed(i)
        model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").eval()
        _randomize(model)
        model.generation_config.eos_token_id = None
        path = tmp_path_factory.mktemp(name)
        model.save_pretrained(path)
        if "oldstyle" in name:
            _to_old_rope_spelling(path / "config.json")
        built[name] = (path, model)
    return built


@pytest.fixture(
    params=[(name, bucketed) for name in CONFIGS for bucketed in (False, True)],
    ids=lambda p: p[0] + ("-bucketed" if p[1] else ""),
)
def case(request, checkpoints):
    """Each checkpoint, run as on CPU and with CUDA's shape buckets (padding rows, tables and
    chunks): the padding must never change a token."""
    name, bucketed = request.param
    path, model = checkpoints[name]
    runner = TorchRunner(str(path), num_blocks=NUM_BLOCKS, block_size=BLOCK)
    if bucketed:
        runner.seq_bucket, runner.block_bucket, runner.token_bucket = SEQ_BUCKET, BLOCK_BUCKET, TOKEN_BUCKET
    return runner, model


def hf_greedy(model, prompt: list[int], n: int = NEW_TOKENS) -> list[int]:
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=n, pad_token_id=0)
    return out[0, len(prompt) :].tolist()


def run_greedy(runner, prompts, tables, n=NEW_TOKENS, chunk=None, starts=None) -> list[list[int]]:
    """Drive `execute` like a scheduler: all sequences advance together each step, prompts are
    prefilled `chunk` tokens at a time, and `starts[i]` tokens are taken as already cached."""
    seqs = [list(p) for p in prompts]
    done = list(starts or [0] * len(prompts))
    outs: list[list[int]] = [[] for _ in prompts]
    while any(len(o) < n for o in outs):
        live = [i for i in range(len(seqs)) if len(outs[i]) < n]
        chunks = []
        for i in live:
            take = seqs[i][done[i] : done[i] + chunk] if chunk else seqs[i][done[i] :]
            sample = done[i] + len(take) == len(seqs[i])
            chunks.append(SeqChunk(take, done[i], tables[i], sample, GREEDY, len(outs[i])))
        for i, c, token in zip(live, chunks, runner.execute(chunks)):
            done[i] += len(c.token_ids)
            if token is not None:
                outs[i].append(token)
                seqs[i].append(token)
    return outs


def _prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(512) for _ in range(n)]


def test_whole_prompt_then_decode(case):
    runner, hf = case
    prompt = _prompt(random.Random(0), 11)
    assert run_greedy(runner, [prompt], [list(range(8))]) == [hf_greedy(hf, prompt)]


def test_chunked_prefill(case):
    runner, hf = case
    prompt = _prompt(random.Random(1), 14)
    assert run_greedy(runner, [prompt], [list(range(8))], chunk=3) == [hf_greedy(hf, prompt)]


def test_batch_of_different_lengths_with_shuffled_blocks(case):
    runner, hf = case
    rng = random.Random(2)
    prompts = [_prompt(rng, n) for n in (1, 5, 12, 21)]
    ids = list(range(NUM_BLOCKS))
    rng.shuffle(ids)
    tables = [ids[i * 8 : (i + 1) * 8] for i in range(len(prompts))]
    assert run_greedy(runner, prompts, tables, chunk=7) == [hf_greedy(hf, p) for p in prompts]


def test_prefix_blocks_reused_across_sequences(case):
    """B lists A's first two (full) blocks and starts past them: it must read A's cached K/V."""
    runner, hf = case
    rng = random.Random(3)
    a = _prompt(rng, 2 * BLOCK + 3)
    b = a[: 2 * BLOCK] + _prompt(rng, 5)
    table_a, fresh = [17, 3, 40, 8, 61, 25], [9, 52, 30, 71]
    table_b = table_a[:2] + fresh
    assert run_greedy(runner, [a], [table_a]) == [hf_greedy(hf, a)]
    out_b = run_greedy(runner, [b], [table_b], starts=[2 * BLOCK])
    assert out_b == [hf_greedy(hf, b)]


def test_sample_false_returns_none_and_blocks_roundtrip(case):
    runner, hf = case
    prompt = _prompt(random.Random(4), 9)
    first = SeqChunk(prompt[:5], 0, [5, 6, 7], False, GREEDY)
    assert runner.execute([first]) == [None]
    saved = runner.read_blocks([5, 6])
    assert saved.shape == (runner.num_layers, 2, 2, BLOCK, runner.num_kv_heads, runner.head_dim)
    runner.write_blocks([10, 11], saved)
    rest = SeqChunk(prompt[5:], 5, [10, 11, 12], True, GREEDY)
    assert runner.execute([rest]) == hf_greedy(hf, prompt, 1)


def test_runner_metadata(checkpoints):
    path, _ = checkpoints["qwen3-qknorm-headdim32-tied"]
    runner = TorchRunner(str(path), num_blocks=4, block_size=BLOCK)
    assert (runner.vocab_size, runner.max_model_len, runner.num_layers) == (512, 256, 2)
    assert (runner.num_kv_heads, runner.head_dim, runner.dtype) == (2, 32, torch.float32)
    assert runner.kv_bytes_per_token == 2 * 2 * 2 * 32 * 4
    assert blocks_that_fit(str(path), 10 * BLOCK * runner.kv_bytes_per_token, BLOCK, torch.float32) == 10


def test_eos_ids_merge_config_and_generation_config(tmp_path):
    """A runner built without a tokenizer stops on config.json's first EOS, then the generation
    config's (workers/generation_defaults.py has the rule a worker's command line applies)."""
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, 2, 9]}))
    assert default_eos_ids(str(tmp_path), {"eos_token_id": 2}) == (2, 7, 9)
    assert default_eos_ids(str(tmp_path), {"eos_token_id": [5, 6]}) == (5, 7, 2, 9)
    empty = tmp_path / "empty"
    empty.mkdir()
    assert default_eos_ids(str(empty), {"eos_token_id": None}) == ()
