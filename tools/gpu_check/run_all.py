"""Run the GPU check's parts one by one, each under its own timeout, into one JSON file.

    python tools/gpu_check/run_all.py --out OUT_DIR [--budget-s 450] [--only NAME ...] [--device cuda]

Called by ``tools/gpu_check.sh`` (which installs the carried megatron-core wheel and sets
``PYTHONPATH`` first). Parts, in order of value: ``env``, the planner's measured rows for the four
presets (``plan_*``), the megatron-core A/B (``ab_mcore``), the no-host-sync test of router capture
(``router_capture_sync``; absent is recorded, not an error), and ``bench_monitors`` at hidden 4096
and 8192 (on the GPU, through ``bench_monitors_cuda.py``). A part that fails, times out or is
skipped for lack of time is recorded with its status, exit code, seconds and the tail of its
output; the others still run. Every part's JSON output is embedded, so ``OUT_DIR`` ends up with
two files: ``gpu_check.json`` and ``gpu_check.log`` (the device tool brings back at most 8).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Optional, Sequence

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TAIL_CHARS = 4000
MIN_PART_S = 15
"""A part is skipped when less than this is left of the budget."""

PLAN_ROWS = {
    "llama3-8b": ["--tp", "1", "--pp", "1", "--dp", "64"],
    "llama3-70b": ["--tp", "8", "--pp", "4", "--dp", "32"],
    "llama3-405b": ["--tp", "8", "--pp", "14", "--dp", "128"],
    "deepseek-v3": ["--tp", "1", "--pp", "1", "--dp", "1024", "--ep", "64"],
}


@dataclass
class Part:
    name: str
    argv: list[str]
    timeout_s: float
    json_file: Optional[str] = None
    """Read the part's JSON from this file (else from its stdout)."""
    requires: Optional[str] = None
    """A path (relative to the repository) that must exist, else the part is ``absent``."""
    env: dict = field(default_factory=dict)


def parts(python: str, device: str, tmp: str) -> list[Part]:
    tool = os.path.join(ROOT, "tools")
    env_code = (
        "import json, platform, torch\n"
        "info = {'python': platform.python_version(), 'torch': torch.__version__, "
        "'cuda_available': torch.cuda.is_available(), 'cuda': torch.version.cuda}\n"
        "if torch.cuda.is_available():\n"
        "    p = torch.cuda.get_device_properties(0)\n"
        "    info.update(device=p.name, memory_gib=p.total_memory / 2**30, sm_count=p.multi_processor_count)\n"
        "try:\n"
        "    import megatron.core as mc; info['megatron_core'] = mc.__version__\n"
        "except Exception as exc:\n"
        "    info['megatron_core'] = f'not importable: {exc}'\n"
        "print(json.dumps(info))\n"
    )
    out = [Part("env", [python, "-c", env_code], 60)]
    for model, layout in PLAN_ROWS.items():
        out.append(Part(f"plan_{model}", [python, os.path.join(tool, "mechmon_plan.py"), "--model", model, *layout,
                                          "--device", device, "--repeats", "3", "--json"], 90))
    ab_json = os.path.join(tmp, "ab.json")
    ab = [python, os.path.join(tool, "gpu_check", "bench_mcore_ab.py"), "--device", device, "--json-out", ab_json]
    if device == "cpu":
        ab += ["--tiny", "--steps-per-arm", "10", "--interval", "5", "--delta", "5", "--repeats", "1"]
    out.append(Part("ab_mcore", ab, 180, json_file=ab_json))
    out.append(Part("router_capture_sync", [python, "-m", "pytest", "tests/session/test_router_capture_sync.py", "-q",
                                            "-p", "no:cacheprovider"], 90,
                    requires="tests/session/test_router_capture_sync.py"))
    bench = os.path.join(tool, "gpu_check", "bench_monitors_cuda.py")
    for hidden, heads in ((4096, 32), (8192, 64)):
        out.append(Part(f"bench_monitors_{hidden}",
                        [python, bench, "--device", device, "--hidden", str(hidden), "--num-heads", str(heads),
                         "--head-dim", "128", "--num-groups", "8", "--dense-heads", "1", "--json"],
                        90 if hidden == 4096 else 180))
    return out


def _parse_json(text: str) -> Optional[object]:
    """The JSON object a part printed (from its first line that starts with ``{``)."""
    lines = text.splitlines()
    for i, line in enumerate(lines):
        if line.startswith("{"):
            try:
                return json.loads("\n".join(lines[i:]))
            except json.JSONDecodeError:
                continue
    return None


def run_part(part: Part, timeout_s: float, log) -> dict:
    """Run one part in its own process group; kill the group on timeout."""
    record: dict = {"argv": part.argv, "timeout_s": timeout_s}
    if part.requires and not os.path.exists(os.path.join(ROOT, part.requires)):
        record.update(status="absent", reason=f"{part.requires} does not exist in this tree")
        return record
    start = time.perf_counter()
    proc = subprocess.Popen(part.argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, env={**os.environ, **part.env})
    try:
        stdout, stderr = proc.communicate(timeout=timeout_s)
        status = "ok" if proc.returncode == 0 else "failed"
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        status = "timeout"
    seconds = time.perf_counter() - start
    record.update(status=status, returncode=proc.returncode, seconds=round(seconds, 2))
    result = None
    if part.json_file and os.path.exists(part.json_file):
        with open(part.json_file, encoding="utf-8") as f:
            result = _parse_json(f.read())
    if result is None:
        result = _parse_json(stdout)
    if result is not None:
        record["result"] = result
    else:
        record["stdout_tail"] = stdout[-TAIL_CHARS:]
    if status != "ok":
        record["stderr_tail"] = stderr[-TAIL_CHARS:]
    log.write(f"===== {part.name}: {status} ({seconds:.1f} s, rc {proc.returncode})\n")
    log.write(f"$ {' '.join(part.argv)}\n--- stdout (tail)\n{stdout[-TAIL_CHARS:]}\n--- stderr (tail)\n"
              f"{stderr[-TAIL_CHARS:]}\n")
    log.flush()
    return record


def main(argv: Optional[Sequence[str]] = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="folder for gpu_check.json and gpu_check.log")
    p.add_argument("--python", default=sys.executable)
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="cpu: a smoke run of the same parts")
    p.add_argument("--budget-s", type=float, default=450.0, help="wall-time budget of all parts together")
    p.add_argument("--only", nargs="*", default=None, help="run only these parts (names as in the JSON)")
    args = p.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    started = time.perf_counter()
    report: dict = {
        "date_utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M"),
        "device": args.device, "budget_s": args.budget_s, "parts": {},
    }
    json_path = os.path.join(args.out, "gpu_check.json")
    with tempfile.TemporaryDirectory() as tmp, open(os.path.join(args.out, "gpu_check.log"), "a",
                                                    encoding="utf-8") as log:
        for part in parts(args.python, args.device, tmp):
            if args.only is not None and part.name not in args.only:
                continue
            left = args.budget_s - (time.perf_counter() - started)
            if left < MIN_PART_S:
                report["parts"][part.name] = {"status": "skipped", "reason": f"time budget: {left:.0f} s left"}
            else:
                report["parts"][part.name] = run_part(part, min(part.timeout_s, left), log)
            report["wall_s"] = round(time.perf_counter() - started, 1)
            with open(json_path, "w", encoding="utf-8") as f:  # rewritten after every part
                json.dump(report, f, indent=2)
    summary = {name: r["status"] for name, r in report["parts"].items()}
    print(json.dumps({"gpu_check": json_path, "wall_s": report.get("wall_s"), "parts": summary}, indent=2))
    return report


if __name__ == "__main__":
    main()
