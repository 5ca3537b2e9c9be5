# Two commands do everything from a bare clone (Python 3.11 + pip):
#   make demo   set up, then train `small` on the default corpus on 2 simulated
#               nodes, kill one node mid-run and recover (a failure drill)
#   make test   set up, lint (ruff, the import-linter contracts), then run the test suite
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
STAMP := $(VENV)/.megatier-installed

.PHONY: install demo lint test test-slow clean gpu-wheels gpu-check

install: $(STAMP)

# Re-runs only when setup.py or the native sources change. torch is pinned to
# the CPU build first; --no-build-isolation then builds megatier._C against it.
$(STAMP): setup.py $(wildcard megatier/csrc/*) $(wildcard megatier/csrc/cuda/*)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip setuptools wheel
	$(PIP) install --quiet torch==2.13.0
	$(PIP) install --quiet pybind11 ninja
	$(PIP) install --quiet --no-build-isolation -e '.[dev]'
	# torchtitan (tests/torchtitan_llama.py, the interop tests' reference) pins datasets<4.8 and pulls torchdata,
	# wandb, tensorboard, pillow: --no-deps, with only what its Llama model and checkpoint code import.
	$(PIP) install --quiet --no-deps 'torchtitan>=0.3,<0.4' 'spmd_types==0.2.3' 'torch_checkpointing>=0.1' tyro einops
	$(PIP) install --quiet docstring-parser typeguard
	touch $@

# Each demo gets a fresh directory: a drill never reuses an earlier job's checkpoints.
DEMO_DIR ?= runs/demo_drill/$(shell date +%Y%m%d-%H%M%S)

demo: install
	$(VENV)/bin/megatier-drill --recovery inprocess --nodes 2 --procs-per-node 1 --fail node --at-step 247 \
		--work-dir $(DEMO_DIR) -- experiment=demo

lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/lint-imports

# `make test` is the suite CI runs (~55 min on 2 cores); `make test-slow` the long drills and the further cases of
# parametrized tests (marked slow), with the CUDA compiler packages its compile check needs.
test: lint
	$(PY) -m pytest -n 2 -m "not slow" --durations=25 tests

test-slow: install
	$(PY) -m tools.cuda_compile install
	$(PY) -m pytest -n 2 -m slow --durations=25 tests

# The lent GPU machine has no network: fetch here the pure-Python wheels it lacks (docs/benchmarks.md, "GPU").
gpu-wheels: install
	$(PY) -m tools.gpu.wheels --dest build/gpu-wheels

# On the GPU machine (carry build/gpu-wheels): build, test and benchmark there, results under $$OUT. DRY=1 runs
# here every phase that needs no GPU (the test suite does too).
gpu-check:
	bash tools/gpu/check.sh $(if $(DRY),--dry,)

clean:
	rm -rf build *.egg-info megatier/*.so runs outputs
