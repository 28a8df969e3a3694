# Two commands for a new user: `make demo` (the main job) and `make test` (lint, then the whole suite).
# Both create .venv on first use; nothing needs installing by hand.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.mechmon-installed
PYTEST_ARGS ?=

.PHONY: venv lint test test-slow demo bench gpu-wheels clean

$(STAMP): setup.py pyproject.toml tools/requirements/pinned-cpu.txt tools/bootstrap_venv.sh
	bash tools/bootstrap_venv.sh $(VENV)
	touch $(STAMP)

venv: $(STAMP)

# ruff (style, imports, bugbear, pyupgrade) on the whole tree; mypy on the core and the session.
# Configuration: pyproject.toml.
lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy

test: lint
	$(PY) -m pytest tests -q --durations=15 $(PYTEST_ARGS)

# Opt-in slow tests (long fault-study runs, end-to-end Megatron-LM, SLURM): see tests/README.md.
test-slow: $(STAMP)
	MECHMON_SLOW=1 $(PY) -m pytest tests -q -m slow $(PYTEST_ARGS)

demo: $(STAMP)
	$(PY) tools/demo.py

bench: $(STAMP)
	$(PY) tools/bench_monitors.py --hidden 4096 --num-heads 32 --head-dim 128 --json

# The wheels tools/gpu_check.sh installs on a GPU machine without network (git-ignored .whl/,
# carried to the device with the working tree).
gpu-wheels:
	bash tools/gpu_check/fetch_wheels.sh

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
