# fzero: two commands on a fresh machine.
#   make demo   install, then train the example GPT and print a sample
#   make test   install, then run the whole suite (CI runs this)
#   make test-fast   the suite without the multi-rank and slow tests (tests/conftest.py
#                    checks that every test that starts ranks is marked multirank)

PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(VENV)/bin/pip
STAMP  := $(VENV)/.fzero-installed

.PHONY: demo test test-fast install bench clean

install: $(STAMP)

# torch first, pinned: this machine carries a CPU wheel of 2.13.0, and an unpinned `torch`
# would pull a multi-GB CUDA build.
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e '.[test]'
	touch $(STAMP)

# The example's options: `make demo DEMO="--tp 2"` splits its heads and MLPs over the 2 ranks instead.
DEMO ?= --zero 2

demo: install
	$(VENV)/bin/fzero launch --nproc 2 examples/train_gpt.py $(DEMO) --ckpt runs/demo

test: install
	$(PY) -m pytest -q --timeout=900

test-fast: install
	$(PY) -m pytest -q -m "not slow and not multirank" --timeout=300

bench: install
	$(PY) benchmarks/overhead.py

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .hypothesis
