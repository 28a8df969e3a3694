"""The fault study end to end: plan runs, train them, analyse, write results, report and plots.

``run_study`` trains (``runner.launch_runs``) and then calls ``analyze_study``, which only reads
the run directories: a finished study can be re-analysed (other detector settings, fixed
definitions) without retraining (``tools/fault_study.py --analyze-only``).
"""

from __future__ import annotations

import json
import logging
import os
import platform
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any, Optional

from mechmon_megatron.detect.phase_moments import TrainingSchedule
from mechmon_megatron.research.study import analysis, plots, report
from mechmon_megatron.research.study.runner import RunResult, launch_runs
from mechmon_megatron.research.study.scenarios import (
    MECHMON_DIR,
    METRICS_FILE,
    Preset,
    RunSpec,
    plan_runs,
    schedule_of_flags,
)

logger = logging.getLogger(__name__)

PLAN_FILE = "plan.json"


@dataclass(kw_only=True)
class StudyOptions:
    """What to run and where to write it."""

    out_dir: str
    preset: Preset
    scenarios: tuple[str, ...]
    seeds: tuple[int, ...]
    train_iters: Optional[int] = None
    """Steps per run; None: the preset's."""
    calibration_seed: Optional[int] = None
    """Clean seed on which the detector setting is chosen; None: the preset's fixed setting."""
    jobs: int = 2
    trainer: Optional[str] = None
    progress: bool = True
    plots: bool = True


def _versions() -> dict[str, str]:
    out = {"python": platform.python_version()}
    for module in ("torch", "megatron.core", "numpy", "matplotlib"):
        try:
            mod = __import__(module, fromlist=["__version__"])
            out[module] = str(getattr(mod, "__version__", "?"))
        except ImportError:
            out[module] = "absent"
    return out


def _machine() -> dict[str, Any]:
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return {"cpu": model, "cores": os.cpu_count(), "platform": platform.platform()}


def run_study(options: StudyOptions) -> dict[str, Any]:
    """Train every planned run, then analyse; returns the results dict (also written).

    ``OUT/plan.json`` is written before training starts (so an interrupted study can still be
    analysed with ``--analyze-only``, on the steps its runs reached) and again at the end with
    the exit codes and wall times.
    """
    specs = plan_runs(options.scenarios, options.seeds, options.preset, options.train_iters, options.calibration_seed)
    os.makedirs(options.out_dir, exist_ok=True)
    plan = {
        "preset": options.preset.name,
        "scenarios": list(options.scenarios),
        "seeds": list(options.seeds),
        "calibration_seed": options.calibration_seed,
        "train_iters": specs[-1].train_iters if specs else options.train_iters,
        "jobs": options.jobs,
        "detector": dict(options.preset.detector),
        "mechmon_interval": options.preset.mechmon_interval,
        "mechmon_delta": options.preset.mechmon_delta,
        "fa_strength": options.preset.fa_strength,
        "train_wall_s": None,
        "runs": [_spec_json(s, None) for s in specs],
    }
    _write_plan(options.out_dir, plan)
    start = time.monotonic()
    launched = launch_runs(
        specs, options.out_dir, jobs=options.jobs, trainer=options.trainer, progress=options.progress
    )
    plan["train_wall_s"] = time.monotonic() - start
    plan["runs"] = [_spec_json(r.spec, r) for r in launched]
    _write_plan(options.out_dir, plan)
    return analyze_study(options.out_dir, plots_enabled=options.plots)


def run_schedule(plan: Mapping[str, Any], entry: Mapping[str, Any]) -> Optional[TrainingSchedule]:
    """The learning-rate schedule of one run of a plan (``entry``: one of ``plan["runs"]``): its own
    ``lr_schedule``, else the one a plan written before runs recorded theirs holds for all (without
    a peak learning rate, so the replays judge young baselines uncorrected), else None."""
    recorded = entry.get("lr_schedule") or plan.get("lr_schedule")
    if not recorded:
        return None
    return TrainingSchedule(int(recorded["lr_warmup_steps"]), str(recorded["lr_decay_style"]),
                            recorded.get("peak_lr"))


def _write_plan(out_dir: str, plan: dict[str, Any]) -> None:
    with open(os.path.join(out_dir, PLAN_FILE), "w", encoding="utf-8") as f:
        json.dump(plan, f, indent=2)


def _spec_json(spec: RunSpec, result: Optional[RunResult]) -> dict[str, Any]:
    return {
        "scenario": spec.scenario,
        "seed": spec.seed,
        "train_iters": spec.train_iters,
        "fault_onset": spec.fault_onset,
        "router_fault_onset": spec.router_fault_onset,
        "calibration": spec.calibration,
        "run_id": spec.run_id,
        "lr_schedule": asdict(schedule_of_flags(spec.flags)),
        "returncode": None if result is None else result.returncode,
        "wall_s": None if result is None else result.wall_s,
        "error_tail": "" if result is None else result.tail,
    }


def analyze_study(
    out_dir: str,
    plots_enabled: bool = True,
    wall_s: Optional[float] = None,
    setting: Optional[analysis.DetectorSetting] = None,
) -> dict[str, Any]:
    """Analyse the runs listed in ``OUT/plan.json``; write results.json, report.md and plots."""
    plan, data = load_runs(out_dir)
    calibration_log = None
    calib = [e for e in plan["runs"] if e["calibration"]]
    if setting is None and calib:
        setting, calibration_log = analysis.choose_detector_setting(
            data[calib[0]["run_id"]],
            interval=plan.get("mechmon_interval") or 20,
            delta=plan.get("mechmon_delta") or 100,
        )
    if setting is None and plan.get("detector"):
        setting = analysis.DetectorSetting(**plan["detector"])
    setting = setting or analysis.DEFAULT_DETECTOR
    runs = []
    for entry in plan["runs"]:
        run = {key: entry[key] for key in ("scenario", "seed", "train_iters", "fault_onset")}
        run.update(
            analysis.analyze_run(
                data[entry["run_id"]], fault_onset=entry["fault_onset"],
                router_fault_onset=entry.get("router_fault_onset"), setting=setting,
                interval=plan.get("mechmon_interval") or 20, delta=plan.get("mechmon_delta") or 100,
                schedule=run_schedule(plan, entry),
            )
        )
        run.update(
            calibration=entry["calibration"], run_id=entry["run_id"], returncode=entry["returncode"],
            wall_s=entry.get("wall_s"),
            run_dir=os.path.join("runs", entry["run_id"]),
        )
        if entry.get("error_tail"):
            run["error_tail"] = entry["error_tail"]
        runs.append(run)
    results: dict[str, Any] = {
        "study": {
            "preset": plan["preset"],
            "scenarios": plan["scenarios"],
            "seeds": plan["seeds"],
            "calibration_seed": plan["calibration_seed"],
            "train_iters": plan["train_iters"],
            "jobs": plan["jobs"],
            "mechmon_interval": plan.get("mechmon_interval"),
            "mechmon_delta": plan.get("mechmon_delta"),
            "fa_strength": plan.get("fa_strength"),
            "wall_s": plan.get("train_wall_s") if wall_s is None else wall_s,
            "detector": setting.to_dict(),
            "calibration_log": calibration_log,
            "definitions": {
                "divergence": vars_of(analysis.DivergenceRule()),
                "expert_collapse": vars_of(analysis.CollapseRule()),
                "growth_rules": vars_of(analysis.GrowthSetting()),
            },
            "versions": _versions(),
            "machine": _machine(),
        },
        "runs": runs,
    }
    if plots_enabled:
        paths = []
        for run in runs:
            path = os.path.join(out_dir, "plots", f"{run['run_id']}.png")
            try:
                paths.append(plots.plot_run(data[run["run_id"]], run, path))
            except Exception:  # noqa: BLE001 -- a broken plot must not lose the results
                logger.exception("plot of %s failed", run["run_id"])
        results["study"]["plots"] = [os.path.relpath(p, out_dir) for p in paths]
    report.write_results(results, out_dir)
    return results


def load_runs(out_dir: str) -> tuple[dict[str, Any], dict[str, analysis.RunData]]:
    """``OUT/plan.json`` and the recorded data of every run it lists."""
    with open(os.path.join(out_dir, PLAN_FILE), encoding="utf-8") as f:
        plan = json.load(f)
    data = {}
    for entry in plan["runs"]:
        directory = os.path.join(out_dir, "runs", entry["run_id"])
        data[entry["run_id"]] = analysis.RunData.from_files(
            os.path.join(directory, METRICS_FILE), os.path.join(directory, MECHMON_DIR, "mechmon_scalars.jsonl")
        )
    return plan, data


def sensitivity(
    out_dir: str, settings: tuple[analysis.DetectorSetting, ...] = analysis.CALIBRATION_CANDIDATES
) -> list[dict[str, Any]]:
    """Post hoc: what each detector setting would have reported on the recorded reported runs
    (never used to choose the study's setting). One row per setting, see
    :func:`~mechmon_megatron.research.study.report.markdown_sensitivity`."""
    plan, data = load_runs(out_dir)
    entries = [e for e in plan["runs"] if not e["calibration"]]
    rows = []
    for setting in settings:
        runs = []
        for e in entries:
            run = analysis.analyze_run(data[e["run_id"]], fault_onset=e["fault_onset"],
                                       router_fault_onset=e.get("router_fault_onset"), setting=setting,
                                       interval=plan.get("mechmon_interval") or 20,
                                       delta=plan.get("mechmon_delta") or 100, schedule=run_schedule(plan, e))
            runs.append({"scenario": e["scenario"], "seed": e["seed"], **run})
        rows.append({"setting": setting.to_dict(), "runs": runs})
    return rows


def vars_of(obj: Any) -> dict[str, Any]:
    return {name: getattr(obj, name) for name in obj.__slots__}
