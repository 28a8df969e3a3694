"""The documented public names exist at ``mechmon_megatron.monitors`` and the core stays host-free."""

import subprocess
import sys

import mechmon_megatron.monitors as monitors

PUBLIC = [
    "spectral_stats",
    "qk_increment_singular_values",
    "mla_delta2_singular_values",
    "update_singular_values",
    "routing_entropy",
    "router_weight_similarity",
    "router_conditioning_ratio",
    "expert_load",
    "max_violation",
]


def test_public_names_exist():
    for name in PUBLIC:
        assert callable(getattr(monitors, name)), name


def test_core_and_session_never_import_megatron_or_deepspeed():
    code = (
        "import sys, mechmon_megatron.monitors, mechmon_megatron.detect, mechmon_megatron.session.session;"
        "bad = [m for m in sys.modules if m.split('.')[0] in ('megatron', 'deepspeed')];"
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
