# Every target sets up .venv first (idempotent: a stamp file skips the work when nothing changed).
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed
# CPU machines take the local torch 2.13.0 CPU wheel; an unpinned torch would pull GBs of CUDA.
CONSTRAINTS ?= $(if $(shell command -v nvidia-smi 2>/dev/null),,constraints-cpu.txt)
PIP_C   := $(if $(CONSTRAINTS),-c $(CONSTRAINTS),)
# deepspeed is pinned: AutoTP training (and ZeRO-3 with AutoTP, >= 0.19.4) changes quickly
DEPS    := setuptools wheel torch==2.13.0 triton transformers==5.23.0 deepspeed==0.19.8 datasets \
           tensorboard wandb pyyaml pytest pytest-benchmark ruff matplotlib tqdm numpy ninja
# DeepSpeed compiles its CPU ops on first use: `trainers.prebuild` builds them once, at install
# time, into $(VENV)/torch_extensions (where the trainers look), so runs and tests do not wait.
PYTEST_ARGS ?=

.PHONY: install test demo bench gpu-check lint format clean

install: $(STAMP)

$(STAMP): setup.py pyproject.toml constraints-cpu.txt $(wildcard csrc/*)
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q $(PIP_C) $(DEPS)
	$(BIN)/pip install -q $(PIP_C) --no-build-isolation --no-deps -e .
	$(BIN)/python -c "import rlhf_kernels, torch; print('rlhf_kernels', rlhf_kernels.__version__, \
	'torch', torch.__version__, 'native ext:', rlhf_kernels.has_native_ext())"
	$(BIN)/python -m trainers.prebuild
	touch $(STAMP)

test: install
	$(BIN)/python -m pytest tests $(PYTEST_ARGS)

demo: install
	$(BIN)/python -m trainers.demo

bench: install
	$(BIN)/python -m pytest bench --benchmark-only --benchmark-json=bench/results/latest-raw.json
	$(BIN)/python bench/report.py

# On a CUDA machine, with its own python (torch + triton + nvcc already there, no network
# needed): build the native ops in place, run the GPU tests on compiled kernels, then the GPU
# benchmarks -> bench/results/gpu-check-<gpu>-<date>.{json,md}. About 6 minutes on one H100.
# The benchmarks run even when a test fails (a GPU slot is rare); make fails if either did.
# GPU_CHECK_ARGS: e.g. --budget-s 300 (rows are saved as they come), --only attention gae.
GPU_PY ?= python3
GPU_CHECK_ARGS ?=
gpu-check:
	$(GPU_PY) setup.py -q build_ext --inplace
	status=0; export PYTHONPATH=$(CURDIR)$(if $(PYTHONPATH),:$(PYTHONPATH)); \
	$(GPU_PY) -m pytest tests -m gpu -q -p no:cacheprovider -o addopts="" \
	    --ignore-glob='tests/test_trainer*' --ignore-glob='tests/test_*demo.py' \
	    --ignore=tests/test_ppo.py || status=$$?; \
	$(GPU_PY) bench/gpu_check.py $(GPU_CHECK_ARGS) || status=$$?; \
	exit $$status

lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

format: install
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .

clean:
	rm -rf $(VENV) build *.egg-info rlhf_kernels/*.so
