# Two commands for a new user: `make demo` (the main job) and `make test` (lint, then the whole suite);
# `make test-current` runs the suite again on Python 3.12 with megatron-core 0.19 (.venv-current).
# Each creates its venv on first use; nothing needs installing by hand.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.mechmon-installed
PYTEST_ARGS ?=

# The current leg: Python 3.12, torch from the package index (a CUDA build that runs on CPU),
# megatron-core 0.19.x, DeepSpeed (tools/requirements/pinned-current.txt); see tests/README.md.
VENV_CURRENT ?= .venv-current
PY_CURRENT := $(VENV_CURRENT)/bin/python
STAMP_CURRENT := $(VENV_CURRENT)/.mechmon-installed

.PHONY: venv venv-current lint test test-current test-slow demo bench gpu-wheels clean

$(STAMP): setup.py pyproject.toml mechmon_megatron/_version.py examples/pretrain_scripts/setup.py \
          tools/requirements/pinned-cpu.txt tools/bootstrap_venv.sh
	bash tools/bootstrap_venv.sh $(VENV)
	touch $(STAMP)

venv: $(STAMP)

$(STAMP_CURRENT): setup.py pyproject.toml mechmon_megatron/_version.py examples/pretrain_scripts/setup.py \
                  tools/requirements/pinned-current.txt tools/bootstrap_current_venv.sh
	bash tools/bootstrap_current_venv.sh $(VENV_CURRENT)
	touch $(STAMP_CURRENT)

venv-current: $(STAMP_CURRENT)

# ruff (style, imports, bugbear, pyupgrade) on the whole tree; mypy on the core and the session.
# Configuration: pyproject.toml.
lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy

test: lint
	$(PY) -m pytest tests -q --durations=15 $(PYTEST_ARGS)

# The whole suite on the current stack (no lint: `make test` lints the same tree).
test-current: $(STAMP_CURRENT)
	$(PY_CURRENT) -m pytest tests -q --durations=15 $(PYTEST_ARGS)

# nvidia-resiliency-ext's launcher in a folder of its own, for the one test that supervises it.
NVRX := $(VENV)/nvrx
NVRX_STAMP := $(NVRX)/.mechmon-installed
$(NVRX_STAMP): $(STAMP) tools/requirements/nvrx.txt
	$(PY) -m pip install -q --upgrade --no-deps --target $(NVRX) -r tools/requirements/nvrx.txt
	touch $@

# Opt-in slow tests (long fault-study runs, end-to-end Megatron-LM, SLURM): see tests/README.md.
# The ft_launcher test runs again, alone, with nvidia-resiliency-ext importable (skipped in the
# first run, where it is not; required in the second).
test-slow: $(STAMP) $(NVRX_STAMP)
	MECHMON_SLOW=1 $(PY) -m pytest tests -q -m slow $(PYTEST_ARGS)
	MECHMON_SLOW=1 MECHMON_REQUIRE_NVRX=1 PYTHONPATH=$(abspath $(NVRX)) $(PY) -m pytest -q -m slow \
	    tests/supervise/test_trainer_recovery.py -k nvidia_resiliency_ext -rs

demo: $(STAMP)
	$(PY) tools/demo.py

bench: $(STAMP)
	$(PY) tools/bench_monitors.py --hidden 4096 --num-heads 32 --head-dim 128 --json

# The wheels tools/gpu_check.sh installs on a GPU machine without network (git-ignored .whl/,
# carried to the device with the working tree).
gpu-wheels:
	bash tools/gpu_check/fetch_wheels.sh

clean:
	rm -rf $(VENV) $(VENV_CURRENT) .pytest_cache .hypothesis
