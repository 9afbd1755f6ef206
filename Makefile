# Every target installs what it needs; a fresh clone needs only python3.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: setup test lint bench clean

setup: $(STAMP)

# torch is pinned here (CPU build on these machines), not in pyproject:
# GPU users bring their own CUDA torch.
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev]'
	touch $(STAMP)

test: setup
	$(PY) -m pytest -q

lint: setup
	$(VENV)/bin/ruff check .

bench: setup
	$(PY) bench/offline_throughput.py

clean:
	rm -rf $(VENV) build *.egg-info
