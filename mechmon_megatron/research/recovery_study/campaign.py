"""The recovery study: three operators on the same fault runs of the CPU toy.

A cell is one fault at one seed, trained with the fault study's model and schedule (preset
``full`` of ``research/study/scenarios.py``: 1,500 steps, LR decaying over them, monitors every
20 steps over a 100-step window in ``log`` mode, a save every 100 steps); an FA cell whose onset
lies later trains ``onset + 1,000`` steps with the LR decaying over them (onset 2,000: 3,000
steps), so every FA fault has the same 1,000 steps to act:

- ``fa``: the amplified FA fault (``strength`` BF16 ulps, all rows) from ``onset``;
- ``moe-lr``: the whole-model 4x learning rate from step 1.

Per seed and schedule the clean run (``OUT/clean-seed<N>``, ``OUT/clean-seed<N>-<steps>`` for a
longer one) trains once from scratch; an FA cell's operators
start from its checkpoint at ``onset - 100`` (copied into each operator's own checkpoint folder:
nothing is shared after the fork), as the fault study forked its runs; a moe-lr cell's operators
start from scratch. Every launch resumes (``launch.py``), so ``run`` can be killed and rerun.

Per operator (:func:`summarize`): restarts, steps trained and then discarded (rolled back, or
trained past a spike before the restart), extra wall time (the discarded steps' own step times
plus the start-up of every extra launch; a loaded shared machine, so upper bounds), whether the
cause was removed (the fault's flags gone from the last launch; for the LR fault the LR back at
the base value), the last launch's exit code, and the loss at the last step smoothed over the
last 100 steps against the clean run of the same seed.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import statistics
import sys
from dataclasses import dataclass
from typing import Any, Optional

from mechmon_megatron.research.recovery_study.launch import LaunchState, kept_trajectory, stdout_of
from mechmon_megatron.research.recovery_study.operators import (
    recovery_records,
    run_mechmon,
    run_plain,
    run_practice,
    without_mechmon,
)
from mechmon_megatron.research.study.analysis import DivergenceRule
from mechmon_megatron.research.study.runner import trainer_command
from mechmon_megatron.research.study.scenarios import get_preset, get_scenario, trainer_flags, with_overrides
from mechmon_megatron.supervise.checkpoints import MEGATRON_TRACKER
from mechmon_megatron.supervise.command import flag_values, parse_command, set_flag

OPERATORS = ("none", "practice", "mechmon")
SMOOTH_STEPS = 100
TARGET_LOSS_GAP = 0.02
"""Target: the mechmon operator ends within 2 % of the clean run's smoothed loss."""
SAVE_INTERVAL = 100
STEPS_AFTER_ONSET = 1000
"""An FA cell trains to ``onset + STEPS_AFTER_ONSET`` (at least the preset's 1,500 steps)."""
RECORD_VERSION = 1
CURVE_STEPS = 20
"""Loss curves in the records (for the plot): the mean loss of each 20-step block."""


@dataclass(frozen=True)
class Cell:
    scenario: str
    """``fa`` or ``moe-lr``."""
    seed: int
    strength: float = 32.0
    onset: int = 500

    @property
    def cell_id(self) -> str:
        if self.scenario == "fa":
            return f"fa-s{self.strength:g}-on{self.onset}-seed{self.seed}"
        return f"{self.scenario}-seed{self.seed}"

    @property
    def fork(self) -> int:
        """The clean checkpoint the operators start from (0: from scratch)."""
        return self.onset - SAVE_INTERVAL if self.scenario == "fa" else 0

    @property
    def train_iters(self) -> int:
        base = get_preset("full").train_iters
        return max(base, self.onset + STEPS_AFTER_ONSET) if self.scenario == "fa" else base


def parse_cell(text: str) -> Cell:
    """``fa:32:500:1`` (scenario:strength:onset:seed) or ``moe-lr:1``."""
    parts = text.split(":")
    cell: Optional[Cell] = None
    try:
        if parts[0] == "fa" and len(parts) == 4:
            cell = Cell("fa", int(parts[3]), float(parts[1]), int(parts[2]))
        elif parts[0] == "moe-lr" and len(parts) == 2:
            cell = Cell("moe-lr", int(parts[1]))
    except ValueError:
        cell = None
    if cell is None:
        raise ValueError(f"--cells: expected fa:STRENGTH:ONSET:SEED or moe-lr:SEED, got {text!r}")
    if cell.scenario == "fa" and not (SAVE_INTERVAL < cell.onset and cell.onset % SAVE_INTERVAL == 0):
        raise ValueError(f"--cells {text}: the onset must be a multiple of the save interval {SAVE_INTERVAL} "
                         f"above it (the operators fork from the clean run's save at onset - {SAVE_INTERVAL})")
    return cell


def _flags(cell: Cell, scenario: str) -> list[str]:
    preset = get_preset("full")
    iters = cell.train_iters
    decay = preset.lr_decay_iters or preset.train_iters
    preset = with_overrides(preset, fa_strength=cell.strength, fa_onset=cell.onset, lr_decay_iters=max(decay, iters))
    return list(trainer_flags(get_scenario(scenario), preset, cell.seed, iters))


def _command(flags: list[str], ckpt: str, out_dir: str, fork: int) -> list[str]:
    argv = [*trainer_command(python=sys.executable), *flags, "--num-threads", "1",
            "--save", ckpt, "--save-interval", str(SAVE_INTERVAL),
            "--mechmon-log-dir", os.path.join(out_dir, "mechmon"),
            "--metrics-jsonl", os.path.join(out_dir, "metrics.jsonl")]
    if fork:
        argv += ["--load", ckpt, "--ckpt-step", str(fork)]
    return argv


def clean_dir(out: str, cell: Cell) -> str:
    """The clean run a cell is compared with (and forks from): same seed, same schedule."""
    if cell.train_iters == get_preset("full").train_iters:
        return os.path.join(out, f"clean-seed{cell.seed}")
    return os.path.join(out, f"clean-seed{cell.seed}-{cell.train_iters}")


def _fork_into(clean_ckpt: str, ckpt: str, fork: int) -> None:
    """Copy the clean run's checkpoint at ``fork`` into an operator's own folder (once)."""
    name = f"iter_{fork:07d}"
    if os.path.isdir(os.path.join(ckpt, name)):
        return
    source = os.path.join(clean_ckpt, name)
    if not os.path.isdir(source):
        raise RuntimeError(f"the clean run has no checkpoint {source}: run the clean run first")
    os.makedirs(ckpt, exist_ok=True)
    shutil.copytree(source, os.path.join(ckpt, name + ".tmp"), dirs_exist_ok=True)
    os.replace(os.path.join(ckpt, name + ".tmp"), os.path.join(ckpt, name))
    with open(os.path.join(ckpt, MEGATRON_TRACKER), "w", encoding="utf-8") as f:
        f.write(str(fork))


def run_clean(out: str, cell: Cell) -> LaunchState:
    directory = clean_dir(out, cell)
    ckpt = os.path.join(directory, "ck")
    return run_plain(directory, _command(_flags(cell, "clean"), ckpt, directory, 0), ckpt)


def run_operator(out: str, cell: Cell, operator: str) -> LaunchState:
    directory = os.path.join(out, cell.cell_id, operator)
    ckpt = os.path.join(directory, "ck")
    if cell.fork:
        _fork_into(os.path.join(clean_dir(out, cell), "ck"), ckpt, cell.fork)
    argv = _command(_flags(cell, cell.scenario), ckpt, directory, cell.fork)
    if operator == "none":
        return run_plain(directory, argv, ckpt)
    if operator == "practice":
        prefix = kept_trajectory(LaunchState.load(clean_dir(out, cell))) if cell.fork else {}
        return run_practice(directory, without_mechmon(argv), ckpt, cell.fork, prefix)
    if operator == "mechmon":
        command = parse_command(argv)
        host = set_flag(command.host_args, "--mechmon-action", ["checkpoint-and-abort"])
        return run_mechmon(directory, list(command.with_host_args(host).argv), ckpt)
    raise ValueError(f"unknown operator {operator!r}; choose from {OPERATORS}")


def run_cell(out: str, cell: Cell, operators: tuple[str, ...] = OPERATORS,
             records: Optional[str] = None) -> dict[str, Any]:
    """Train what is missing of ``cell`` (the clean run first), then its record (written to
    ``records`` after every operator, so a study cut short keeps what finished)."""
    run_clean(out, cell)
    for op in operators:
        run_operator(out, cell, op)
        if records:
            write_record(summarize(out, cell), records, out)
    return summarize(out, cell)


# ------------------------------------------------------------------------------------------ summary
def _smoothed(kept: dict[int, dict], last_step: int) -> Optional[float]:
    values = [float(r["lm_loss"]) for i, r in kept.items()
              if last_step - SMOOTH_STEPS < i <= last_step and r.get("lm_loss") is not None]
    if len(values) < SMOOTH_STEPS // 2 or not all(math.isfinite(v) for v in values):
        return None
    return statistics.fmean(values)


def loss_curve(rows: dict[int, dict], block: int = CURVE_STEPS) -> list[list[Optional[float]]]:
    """``[[step, mean loss], ...]``: one point per ``block``-step block that ``rows`` (iteration ->
    metrics row) reaches, at the block's last step (a multiple of ``block``); the mean of its finite
    losses to 5 decimals, or None when it has none (a diverged stretch: the plot leaves a gap)."""
    blocks: dict[int, list[float]] = {}
    for i, row in rows.items():
        loss = row.get("lm_loss")
        end = -(-i // block) * block
        blocks.setdefault(end, [])
        if loss is not None and math.isfinite(float(loss)):
            blocks[end].append(float(loss))
    return [[end, round(statistics.fmean(v), 5) if v else None] for end, v in sorted(blocks.items())]


def _thrown_away(state: LaunchState) -> list[dict[int, dict]]:
    """Per launch but the last: its metrics rows after the next launch's start step (trained, then
    discarded by a rollback or a restart before them), iteration -> row, in order."""
    from mechmon_megatron.research.recovery_study.launch import read_rows

    out = []
    for k, launch in enumerate(state.launches[:-1]):
        nxt = state.launches[k + 1].start_iteration
        rows = {int(r["iteration"]): r for r in read_rows(launch.metrics_path(state.directory))}
        out.append({i: r for i, r in sorted(rows.items()) if i > nxt})
    return out


def _discarded_curves(state: LaunchState) -> list[list[list[Optional[float]]]]:
    """The loss curve of each stretch that a later launch threw away."""
    return [loss_curve(lost) for lost in _thrown_away(state) if lost]


def _alarms(text: str) -> list[str]:
    return [line.strip() for line in text.splitlines() if "[mechmon] ALARM at iteration" in line]


def _log_mode_alarms(directory: str) -> list[int]:
    """Checks where the monitors (``log`` mode: nothing acts) raised ``mechmon/alarm``."""
    from mechmon_megatron.research.recovery_study.launch import read_rows

    rows = read_rows(os.path.join(directory, "mechmon", "mechmon_scalars.jsonl"))
    return sorted({int(r["step"]) for r in rows if float((r.get("scalars") or {}).get("mechmon/alarm", 0) or 0) >= 1})


def _discarded(state: LaunchState) -> tuple[int, float]:
    """Steps trained and later thrown away, and their step times (s)."""
    lost = [r for stretch in _thrown_away(state) for r in stretch.values()]
    return len(lost), sum(float(r.get("step_time_s") or 0.0) for r in lost)


def _startup_s(state: LaunchState) -> float:
    """Wall time of every launch beyond the first that was not spent in training steps."""
    from mechmon_megatron.research.recovery_study.launch import read_rows

    total = 0.0
    for launch in state.launches[1:]:
        rows = read_rows(launch.metrics_path(state.directory))
        total += max(0.0, launch.wall_s - sum(float(r.get("step_time_s") or 0.0) for r in rows))
    return total


def _cause_removed(cell: Cell, argv: list[str]) -> str:
    host = parse_command(argv).host_args
    if cell.scenario == "fa":
        return "yes" if flag_values(host, "--fa-fault-strength") is None else "no"
    lr = float((flag_values(host, "--lr") or ["nan"])[0])
    base = get_preset("full").base_lr
    if lr <= base * 1.0001:
        return "yes"
    return "no" if lr >= get_preset("full").high_lr * 0.9999 else f"partly (LR {lr / base:g}x the base)"


def summarize_operator(out: str, cell: Cell, operator: str, clean_loss: Optional[float]) -> dict[str, Any]:
    directory = os.path.join(out, cell.cell_id, operator)
    state = LaunchState.load(directory)
    if not state.launches:
        return {"status": "not run"}
    kept = kept_trajectory(state)
    if not state.launches[-1].finished:  # cut short: what it reached, and its decisions so far
        partial: dict[str, Any] = {"status": "unfinished", "last_step": max(kept) if kept else cell.fork,
                                   "launches": len(state.launches), "restarts": len(state.launches) - 1,
                                   "wall_s": round(sum(launch.wall_s for launch in state.launches), 1)}
        if operator == "mechmon":
            partial["recovery"] = _recovery(os.path.join(directory, "ck"))
        if operator == "practice":
            partial["spikes"] = state.extra.get("practice", {}).get("rollbacks", [])
        return partial
    last = max(kept) if kept else 0
    loss = _smoothed(kept, cell.train_iters)
    steps, step_s = _discarded(state)
    text = "".join(stdout_of(state, launch) for launch in state.launches)
    divergence = DivergenceRule().first_step(list(kept), [float(r.get("lm_loss") or math.nan) for r in kept.values()])
    final = state.launches[-1]
    body: dict[str, Any] = {
        "status": "done", "launches": len(state.launches), "restarts": len(state.launches) - 1,
        "steps_discarded": steps, "extra_wall_s": round(step_s + _startup_s(state), 1),
        "wall_s": round(sum(launch.wall_s for launch in state.launches), 1),
        "cause_removed": _cause_removed(cell, final.argv), "exit_code": final.returncode, "last_step": last,
        "loss_smoothed": loss,
        "loss_vs_clean": None if loss is None or clean_loss is None else loss / clean_loss - 1.0,
        "divergence_step": divergence, "alarms": _alarms(text)[:6],
        "log_mode_alarm_steps": _log_mode_alarms(directory) if operator == "none" else [],
        "launch_notes": [launch.note for launch in state.launches if launch.note],
        "loss_curve": loss_curve(kept), "discarded_loss_curves": _discarded_curves(state),
    }
    if operator == "practice":
        body["spikes"] = state.extra.get("practice", {}).get("rollbacks", [])
    if operator == "mechmon":
        body["recovery"] = _recovery(os.path.join(directory, "ck"))
        body["recovered"] = (final.returncode == 0 and body["restarts"] <= 1 and body["loss_vs_clean"] is not None
                             and abs(body["loss_vs_clean"]) <= TARGET_LOSS_GAP)
    return body


def _recovery(ckpt: str) -> list[dict[str, Any]]:
    keys = ("action", "reason", "alert", "checkpoint", "after_change_point", "why", "remedy", "flags_removed",
            "flags_added", "exit_code")
    return [{k: r.get(k) for k in keys} for r in recovery_records(ckpt)]


def environment() -> dict[str, Any]:
    """What a record's numbers depend on beyond its flags: the stack and the CPU (records of one
    cell from two machines or venvs are only comparable when these agree)."""
    import platform
    from importlib import metadata

    from mechmon_megatron.research.reproducible_cpu import PINNED_CPU_SETTINGS

    def version(name: str) -> Optional[str]:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            return None

    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    return {"python": platform.python_version(), "torch": version("torch"), "megatron-core": version("megatron-core"),
            "cpu": cpu, "pinned": dict(PINNED_CPU_SETTINGS)}


def summarize(out: str, cell: Cell) -> dict[str, Any]:
    clean = LaunchState.load(clean_dir(out, cell))
    clean_kept = kept_trajectory(clean) if clean.launches else {}
    clean_loss = _smoothed(clean_kept, cell.train_iters)
    return {
        "version": RECORD_VERSION, "cell": cell.cell_id, "scenario": cell.scenario, "seed": cell.seed,
        "strength": cell.strength if cell.scenario == "fa" else None,
        "onset": cell.onset if cell.scenario == "fa" else 1, "fork": cell.fork, "train_iters": cell.train_iters,
        "smoothing_steps": SMOOTH_STEPS, "clean_loss_smoothed": clean_loss, "environment": environment(),
        "clean_wall_s": round(sum(launch.wall_s for launch in clean.launches), 1),
        "clean_loss_curve": loss_curve({i: r for i, r in clean_kept.items() if i > cell.fork - SAVE_INTERVAL}),
        "operators": {op: summarize_operator(out, cell, op, clean_loss) for op in OPERATORS},
    }


def merged_with_earlier(record: dict[str, Any], path: str) -> dict[str, Any]:
    """``record`` with the operators it has not run taken from the record already at ``path`` (a
    campaign folder on another machine ran them), so an operator rerun alone (``--operators
    mechmon``) joins the others of the same cell. The taken ones are listed under
    ``operators_from_earlier_record``: their ``environment`` may differ (the CPU pin did not give
    the same bits on every machine, docs/RECOVERY.md)."""
    try:
        with open(path, encoding="utf-8") as f:
            earlier = json.load(f)
    except (FileNotFoundError, json.JSONDecodeError):
        return record
    if earlier.get("cell") != record["cell"]:
        return record
    merged = dict(record, operators=dict(record["operators"]))
    taken = []
    for op, body in (earlier.get("operators") or {}).items():
        if merged["operators"].get(op, {}).get("status") == "not run" and body.get("status") != "not run":
            merged["operators"][op] = body
            taken.append(op)
    if taken:
        before = earlier.get("operators_from_earlier_record", [])
        merged["operators_from_earlier_record"] = sorted(set(taken) | set(before))
    if merged.get("clean_loss_smoothed") is None:
        merged["clean_loss_smoothed"] = earlier.get("clean_loss_smoothed")
    return merged


def write_record(record: dict[str, Any], dest: str, out: Optional[str] = None) -> str:
    """Write one cell's record (merged with the operators an earlier record of the cell has and this
    one has not run); with ``out`` (the campaign folder), paths under it are written as ``<out>/...``
    so the committed records name no machine's folders."""
    os.makedirs(dest, exist_ok=True)
    path = os.path.join(dest, f"{record['cell']}.json")
    text = json.dumps(merged_with_earlier(record, path), indent=1, sort_keys=True)
    if out:  # the launches name it as given (maybe relative) and the supervisor as an absolute path
        for prefix in sorted({os.path.abspath(out), os.path.normpath(out)}, key=len, reverse=True):
            text = text.replace(prefix.rstrip(os.sep) + os.sep, "<out>/")
    with open(path, "w", encoding="utf-8") as f:
        f.write(text + "\n")
    return path
