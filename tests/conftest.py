"""Shared fixtures (tiny random checkpoints built at test time, no model hub) and the tiers.

Tiers, marked here so no test file has to remember: a test that starts processes (its module
uses `gateway.procs`, or `subprocess` itself) is `integration`; one that runs a torch model (its
module imports torch, or it uses `tiny_llama`) is `model`. `make test-fast` deselects both (and
`slow`, `vllm`): the pure tests alone, in under a minute.
"""

import subprocess
import sys

import pytest

from gateway import procs

PROCESS_STARTERS = {id(v) for v in vars(procs).values() if callable(v)} | {id(subprocess), id(subprocess.Popen)}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    torch = sys.modules.get("torch")
    for item in items:
        module = getattr(item, "module", None)
        if module is None:
            continue
        held = vars(module).values()
        if any(id(v) in PROCESS_STARTERS for v in held):
            item.add_marker(pytest.mark.integration)
        if (torch is not None and any(v is torch for v in held)) or "tiny_llama" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.model)


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory):
    """A 2-layer Llama-shaped model with GQA and the SmolLM2 tokenizer, saved as an HF folder."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    from workers.model_store import load_tokenizer

    path = tmp_path_factory.mktemp("tiny-llama")
    tok = load_tokenizer("smollm2-135m")
    cfg = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        eos_token_id=tok.eos_token_id,
        bos_token_id=tok.bos_token_id,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(path)
    tok.save_pretrained(path)
    return path
