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
# benchmarks -> $(GPU_OUT)/gpu-check-<gpu>-<date>-<time>.{json,md} and the tests' outcome in
# $(GPU_OUT)/gpu-tests-<date>-<time>.xml (JUnit). The whole target keeps to GPU_SECONDS (one
# deadline from its start; the tests get at most GPU_TEST_SECONDS of what the build left; a
# benchmark row in progress may run over by its own length, about a minute at most), so it fits
# a 10-minute slot.
# The benchmarks run even when a test fails (a GPU slot is rare); make fails if either did.
# GPU_CHECK_ARGS: e.g. --budget-s 300 (rows are saved as they come), --only attention gae.
# GPU_OUT: where results go (a device runner's $$OUT, so they come back even after a kill).
GPU_PY ?= python3
GPU_CHECK_ARGS ?=
GPU_OUT ?= bench/results
GPU_SECONDS ?= 480
GPU_TEST_SECONDS ?= 180
gpu-check:
	export GPU_CHECK_DEADLINE=$$(( $$(date +%s) + $(GPU_SECONDS) )); \
	stamp=$$(date -u +%Y-%m-%d-%H%M%S); mkdir -p $(GPU_OUT); status=0; \
	$(GPU_PY) setup.py -q build_ext --inplace || status=$$?; \
	export PYTHONPATH=$(CURDIR)$(if $(PYTHONPATH),:$(PYTHONPATH)); \
	left=$$(( GPU_CHECK_DEADLINE - $$(date +%s) )); tests_s=$(GPU_TEST_SECONDS); \
	if [ $$left -lt $$tests_s ]; then tests_s=$$(( left > 1 ? left : 1 )); fi; \
	timeout -s INT -k 15 $$tests_s $(GPU_PY) -m pytest tests -m gpu -q -rs \
	    -p no:cacheprovider -o addopts="" --junitxml=$(GPU_OUT)/gpu-tests-$$stamp.xml \
	    --continue-on-collection-errors \
	    --ignore-glob='tests/test_trainer*' --ignore-glob='tests/test_*demo.py' \
	    --ignore=tests/test_ppo.py || status=$$?; \
	$(GPU_PY) bench/gpu_check.py --out-dir $(GPU_OUT) $(GPU_CHECK_ARGS) || status=$$?; \
	exit $$status

lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

format: install
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .

clean:
	rm -rf $(VENV) build *.egg-info rlhf_kernels/*.so
