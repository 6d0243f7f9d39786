"""The vLLM interpreter for tests: skipped without one, except under CI, which builds it."""

import os

import pytest

from bench.vllm_procs import vllm_python


def need_vllm() -> str:
    """The vLLM interpreter; without one the test is skipped, except under CI, where `make test`
    builds it: there a missing vLLM is a failure, not a silent skip."""
    python = vllm_python()
    if python is None:
        message = "no vLLM interpreter: run `make vllm-setup` or set KVGATE_VLLM_PYTHON"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    return python
