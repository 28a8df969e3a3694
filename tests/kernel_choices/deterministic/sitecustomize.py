"""Runs the test suite under ``torch.use_deterministic_algorithms(True)`` in every process.

torch has no environment switch for deterministic algorithms, and most tests start trainers in
subprocesses, so a pytest option would reach only the pytest process. Python imports
``sitecustomize`` at start-up from ``PYTHONPATH``, and the test launchers keep ``PYTHONPATH``:

    PYTHONPATH=tests/kernel_choices/deterministic .venv/bin/python -m pytest tests ...

Every Python process then imports torch at start-up (about 3 s each), which is why this is a
recipe for a kernel-choice run (tests/README.md), not the default.
"""

import importlib.util

if importlib.util.find_spec("torch") is not None:
    import torch

    torch.use_deterministic_algorithms(True)
