"""mechmon-megatron-examples: the example megatron-core trainer (``python -m gpt_trainer``).

A second, repository-only distribution, so the product's wheel never puts a generic top-level
``gpt_trainer`` into a user's site-packages. The trainer needs a checkout: it imports the fault
injectors and CPU shims (``mechmon_megatron.research`` / ``.testing``), which only the source tree
holds. tools/bootstrap_venv.sh and tools/bootstrap_current_venv.sh install it editable next to the
package, so the fault study, the demo and the tests start it as ``python -m gpt_trainer`` from any
directory. The scripts beside it (``pretrain_gpt_mechmon.py``, ...) run as files and are not
installed.
"""

import os
import re

from setuptools import setup

HERE = os.path.dirname(os.path.abspath(__file__))


def _version() -> str:
    """The product's one version number (mechmon_megatron/_version.py, two folders up), read as text."""
    with open(os.path.join(HERE, "..", "..", "mechmon_megatron", "_version.py"), encoding="utf-8") as f:
        match = re.search(r'^__version__ = "([^"]+)"$', f.read(), re.MULTILINE)
    if match is None:
        raise RuntimeError("mechmon_megatron/_version.py has no __version__ line")
    return match.group(1)


VERSION = _version()

setup(
    name="mechmon-megatron-examples",
    version=VERSION,
    description="The example megatron-core GPT / GPT-MoE trainer of mechmon-megatron (repository only)",
    python_requires=">=3.10",
    packages=["gpt_trainer"],
    py_modules=[],
    # The same release of the product (the trainer uses its callback and flags) and megatron-core.
    install_requires=[f"mechmon-megatron=={VERSION}", "megatron-core>=0.16.1"],
    license="Apache-2.0",
)
