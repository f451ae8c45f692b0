# One command sets everything up and runs the demo (`make demo`); one sets up and runs the tests (`make test`).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PYTEST_ARGS ?=

.PHONY: setup demo test clean

$(VENV)/.installed: setup.py
	$(PYTHON) -m venv $(VENV)
	# Without CUDA, take the CPU build of torch first (pip finds the 2.13.0 CPU wheel on this kind of machine);
	# otherwise a plain `torch` requirement would pull a multi-GB CUDA build.
	if ! command -v nvidia-smi >/dev/null 2>&1; then $(PY) -m pip install torch==2.13.0; fi
	$(PY) -m pip install -e '.[test]'
	touch $@

setup: $(VENV)/.installed

demo: setup
	$(PY) examples/cpu_demo.py

test: setup
	$(PY) -m pytest -q -p no:cacheprovider tests $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) *.egg-info
