"""mechmon-megatron: mechanism-driven training-instability monitors for Megatron-LM and DeepSpeed."""

import re

from setuptools import find_packages, setup


def _version() -> str:
    """``__version__`` of mechmon_megatron/_version.py, read as text: building never imports torch."""
    with open("mechmon_megatron/_version.py", encoding="utf-8") as f:
        match = re.search(r'^__version__ = "([^"]+)"$', f.read(), re.MULTILINE)
    if match is None:
        raise RuntimeError("mechmon_megatron/_version.py has no __version__ line")
    return match.group(1)


# Users keep their own torch build (CUDA, ROCm, CPU); we only state the range we test.
INSTALL_REQUIRES = ["torch>=2.4", "numpy>=1.24"]

EXTRAS = {
    "megatron": ["megatron-core>=0.16.1"],
    "deepspeed": ["deepspeed>=0.17"],
    "flash": ["flash-attn>=2.6"],  # GPU only
    # mechmon-scan: safetensors folders, TensorBoard events, the HTML report's plots, the progress bar.
    "scan": ["safetensors>=0.4", "tensorboard>=2.16", "matplotlib>=3.8", "tqdm>=4.66"],
    # mechmon-calibrate: reading a run's TensorBoard events, the progress bar.
    "calibrate": ["tensorboard>=2.16", "tqdm>=4.66"],
    "test": [
        "pytest>=8",
        "hypothesis>=6.100",
        "tensorboard>=2.16",
        "matplotlib>=3.8",
        "tqdm>=4.66",
        "safetensors>=0.4",
    ],
}

def _patch_files() -> list[tuple[str, list[str]]]:
    """Ship patches/megatron-lm/<release>/*.patch for non-editable installs (mechmon-patch)."""
    import glob
    import os

    out = []
    for release_dir in sorted(glob.glob(os.path.join("patches", "megatron-lm", "*"))):
        files = sorted(glob.glob(os.path.join(release_dir, "*.patch")))
        if files:
            out.append((os.path.join("share", "mechmon-megatron", release_dir), files))
    return out


setup(
    name="mechmon-megatron",
    version=_version(),
    description=(
        "Mechanism-driven monitors (QK-increment spectral entropy, MoE routing entropy) "
        "for Megatron-LM and DeepSpeed pre-training"
    ),
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    # The product only. mechmon_megatron.research (the studies) and mechmon_megatron.testing (CPU
    # shims) stay in the source tree: the editable install of a checkout (`make venv`) imports them
    # from there, a wheel never ships them. The example trainer (top-level ``gpt_trainer``) is its
    # own distribution, examples/pretrain_scripts/setup.py. tests/test_packaging.py lists the wheel.
    packages=find_packages(include=["mechmon_megatron", "mechmon_megatron.*"],
                           exclude=["mechmon_megatron.research", "mechmon_megatron.research.*",
                                    "mechmon_megatron.testing", "mechmon_megatron.testing.*"]),
    install_requires=INSTALL_REQUIRES,
    extras_require=EXTRAS,
    data_files=_patch_files(),
    package_data={"mechmon_megatron.detect": ["null_tails.json"],
                  "mechmon_megatron.supervise": ["default_policy.json"]},
    entry_points={"console_scripts": [
        "mechmon-patch=mechmon_megatron.adapters.megatron_lm.patch_tool:main",
        "mechmon-run=mechmon_megatron.adapters.megatron_lm.run:main",
        "mechmon-calibrate=mechmon_megatron.calibrate.cli:main",
        "mechmon-plan=mechmon_megatron.plan.cli:main",
        "mechmon-scan=mechmon_megatron.scan.cli:main",
        "mechmon-supervise=mechmon_megatron.supervise.cli:main",
    ]},
    license="Apache-2.0",
)
