# fzero: two commands on a fresh machine.
#   make demo   install, then train the example GPT and print a sample
#   make test   install, then run the whole suite (CI runs this) in TEST_WORKERS processes
#   make test-fast   the suite without the multi-rank and slow tests (tests/conftest.py
#                    checks that every test that starts ranks is marked multirank)
#   make gpu-wheels  (here) the wheels a lent GPU machine lacks, into .whl/
#   make gpu-check   (there, carrying .whl) GPU tests and step benchmarks inside 6 minutes;
#                    always leaves benchmarks/results/gpu.json (docs/performance.md, GPU)
#   make gpu-diagnose (there, after gpu-check) host-vs-GPU time of one step and where the
#                    GPU bytes go with and without offload, into benchmarks/results/ (2 minutes)

PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(VENV)/bin/pip
STAMP  := $(VENV)/.fzero-installed

.PHONY: demo test test-fast install bench gpu-wheels gpu-check gpu-diagnose clean

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

# Two test processes (pytest-xdist): the suite's processes wait as much as they compute
# (imports, rendezvous, timeouts a fault test waits out), so two keep both cores busier.
TEST_WORKERS ?= 2

test: install
	$(PY) -m pytest -q -n $(TEST_WORKERS) --timeout=900

test-fast: install
	$(PY) -m pytest -q -m "not slow and not multirank" --timeout=300

bench: install
	$(PY) benchmarks/overhead.py

# The lent GPU machine has torch, triton, pytest, pytest-timeout and hypothesis in its
# python3 (3.12) but no optree and no internet: the wheel travels in .whl/ (git-ignored).
GPU_PYTHON ?= python3
GPU_BUDGET ?= 360
GPU_SITE   ?= /tmp/site
OPTREE     ?= optree==0.20.0

gpu-wheels:
	@ls .whl/optree-*cp312*.whl >/dev/null 2>&1 || $(PYTHON) -m pip download -q --no-deps --only-binary=:all: \
		--python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64 \
		--platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
		-d .whl $(OPTREE)
	@ls .whl

gpu-check:
	@if [ -d .whl ] && ! $(GPU_PYTHON) -c 'import optree' 2>/dev/null; then \
		$(GPU_PYTHON) -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
			--target $(GPU_SITE) .whl/*.whl \
			|| echo "gpu-check: the wheels in .whl/ did not install; going on (phase env names what is missing)"; fi
	PYTHONPATH=$(GPU_SITE):$(CURDIR)$${PYTHONPATH:+:$$PYTHONPATH} PYTHONUNBUFFERED=1 \
		$(GPU_PYTHON) benchmarks/gpu_check.py --budget $(GPU_BUDGET) --out benchmarks/results/gpu.json

gpu-diagnose:
	mkdir -p benchmarks/results
	PYTHONPATH=$(GPU_SITE):$(CURDIR)$${PYTHONPATH:+:$$PYTHONPATH} PYTHONUNBUFFERED=1 timeout 75 \
		$(GPU_PYTHON) benchmarks/gpu_profile.py --preset 124m > benchmarks/results/gpu_profile.txt 2>&1; \
	PYTHONPATH=$(GPU_SITE):$(CURDIR)$${PYTHONPATH:+:$$PYTHONPATH} PYTHONUNBUFFERED=1 timeout 60 \
		$(GPU_PYTHON) benchmarks/gpu_memory.py > benchmarks/results/gpu_memory.txt 2>&1; \
	grep -h "###\|^|\|bytes per" benchmarks/results/gpu_profile.txt benchmarks/results/gpu_memory.txt | head -40; \
	if [ -n "$$OUT" ]; then cp benchmarks/results/gpu_profile.txt benchmarks/results/gpu_memory.txt "$$OUT"/; fi

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .hypothesis
