"""mechmon-scan runs where neither megatron nor deepspeed is installed: importing it loads neither."""

import subprocess
import sys

from tests.scan.series import REPO_ROOT, env


def test_scan_imports_no_host_framework():
    code = ("import sys, mechmon_megatron.scan.runner, mechmon_megatron.scan.cli; "
            "print(sorted(m for m in ('megatron', 'deepspeed') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, env=env(), capture_output=True, text=True,
                         timeout=120, check=True).stdout
    assert out.strip() == "[]", out
