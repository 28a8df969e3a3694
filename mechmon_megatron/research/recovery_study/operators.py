"""The three operators of the recovery study, each resumable (see ``launch.py``).

- ``none``: the fault run trains to its end; nobody intervenes.
- ``practice``: today's practice. Megatron-LM's 10x rule and llm-foundry's 2x-mean rule (the
  published settings, ``research/baselines/symptom_rules.py``) watch the loss; the first to fire
  at step t stops the run, which restarts from the newest checkpoint at or before t - 100 (PaLM's
  "about 100 steps before the spike") with the batches from there to t skipped
  (``--iterations-to-skip``, PaLM's skip), the flags otherwise unchanged; at most 3 restarts, the
  last launch then trains to the end. The rules' state is rebuilt from the kept losses.
- ``mechmon``: ``mechmon-supervise``'s loop (the ``Supervisor`` class itself) with the default
  policy around the fault run with ``--mechmon-action checkpoint-and-abort``; only its launch
  is replaced, by the resumable one.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Optional

from mechmon_megatron.research.baselines.symptom_rules import FoundrySpikeRule, MegatronSpikeRule, SymptomRule
from mechmon_megatron.research.recovery_study.launch import (
    LaunchRecord,
    LaunchState,
    kept_trajectory,
    read_rows,
    run_launch,
)
from mechmon_megatron.supervise.alerts import alert_files
from mechmon_megatron.supervise.checkpoints import list_checkpoints
from mechmon_megatron.supervise.command import flag_values, parse_command, remove_flag, set_flag
from mechmon_megatron.supervise.host import read_host_flags
from mechmon_megatron.supervise.loop import Supervisor, SupervisorConfig, _Episode
from mechmon_megatron.supervise.notify import Notifier
from mechmon_megatron.supervise.policy import load_policy, resolve_policy
from mechmon_megatron.supervise.records import RecoveryLog, RecoveryRecord

PRACTICE_BACK_STEPS = 100
"""PaLM: the restart is about 100 steps before the spike."""
PRACTICE_MAX_RESTARTS = 3


def with_launch_outputs(argv: list[str], metrics: str) -> list[str]:
    command = parse_command(argv)
    return list(command.with_host_args(set_flag(command.host_args, "--metrics-jsonl", [metrics])).argv)


def _start_iteration(argv: list[str]) -> int:
    host = parse_command(argv).host_args
    step = flag_values(host, "--ckpt-step")
    return int(step[0]) if step and flag_values(host, "--load") else 0


def run_plain(directory: str, argv: list[str], ckpt_dir: str) -> LaunchState:
    """One launch to the end (the clean run, the ``none`` operator)."""
    state = LaunchState.load(directory)
    launch = state.launches[0] if state.launches else LaunchRecord(
        index=1, argv=[], start_iteration=_start_iteration(argv), started=time.time())
    launch.argv = with_launch_outputs(argv, launch.metrics_path(directory))
    run_launch(state, launch, ckpt_dir)
    return state


# ---------------------------------------------------------------------------------------- practice
def practice_rules() -> list[SymptomRule]:
    return [MegatronSpikeRule(), FoundrySpikeRule()]


@dataclass
class _Watcher:
    """Feeds a launch's new loss rows to the rules; the first alarm step stops it."""

    rules: list[SymptomRule]
    directory: str
    last: int
    fired: Optional[str] = None

    def __call__(self, launch: LaunchRecord) -> Optional[int]:
        for row in read_rows(launch.metrics_path(self.directory)):
            step = int(row["iteration"])
            if step <= self.last:
                continue
            self.last = step
            loss = row.get("lm_loss")
            value = float("nan") if loss is None else float(loss)
            for rule in self.rules:
                if rule.update(step, value):
                    self.fired = rule.name
                    return step
        return None


def _fed_rules(kept: dict[int, dict], until: int) -> list[SymptomRule]:
    rules = practice_rules()
    for step, row in kept.items():
        if step > until:
            break
        loss = row.get("lm_loss")
        for rule in rules:
            rule.update(step, float("nan") if loss is None else float(loss))
    return rules


def run_practice(directory: str, argv: list[str], ckpt_dir: str, fork: int,
                 prefix: Optional[dict[int, dict]] = None) -> LaunchState:
    """``prefix``: the losses before the fork (the clean run's), which the rules saw in a real run."""
    state = LaunchState.load(directory)
    before = {i: r for i, r in (prefix or {}).items() if i <= fork}
    extra = state.extra.setdefault("practice", {"restarts": 0, "spikes": [], "argv": argv, "skip": [], "handled": 0})
    while True:
        last = state.launches[-1] if state.launches else None
        if last is not None and last.finished:
            if last.stopped_at is None:
                return state
            if extra["handled"] < last.index:
                _restart_after_spike(state, last, ckpt_dir, fork)
        pending = [launch for launch in state.launches if not launch.finished]
        if pending:
            launch = pending[0]
        else:
            launch = LaunchRecord(index=len(state.launches) + 1, argv=[], started=time.time(),
                                  start_iteration=_start_iteration(extra["argv"]))
            launch.argv = with_launch_outputs(extra["argv"], launch.metrics_path(directory))
        watching = extra["restarts"] < PRACTICE_MAX_RESTARTS
        watcher = _Watcher(_fed_rules({**before, **kept_trajectory(state)}, launch.start_iteration), directory,
                           launch.start_iteration)

        def watch(current: LaunchRecord, watcher: _Watcher = watcher) -> Optional[int]:
            step = watcher(current)
            if step is not None:
                current.note = (current.note + f" stopped by {watcher.fired};").strip()
            return step

        run_launch(state, launch, ckpt_dir, watch=watch if watching else None)


def _restart_after_spike(state: LaunchState, launch: LaunchRecord, ckpt_dir: str, fork: int) -> None:
    """Roll back about 100 steps before the spike and skip the batches up to it (PaLM)."""
    extra = state.extra["practice"]
    spike = int(launch.stopped_at or 0)
    rule = launch.note.rpartition("stopped by ")[2].rstrip(";") or "?"
    extra["spikes"].append({"launch": launch.index, "step": spike, "rule": rule})
    target = spike - PRACTICE_BACK_STEPS
    usable = [c for c in list_checkpoints(ckpt_dir) if fork <= c.iteration <= max(fork, target)]
    ckpt = usable[-1].iteration if usable else fork
    skip = sorted({i for i in extra["skip"] if i > ckpt} | set(range(ckpt + 1, spike + 1)))
    extra["skip"] = skip
    command = parse_command(extra["argv"])
    host = set_flag(set_flag(command.host_args, "--load", [ckpt_dir]), "--ckpt-step", [str(ckpt)])
    host = set_flag(host, "--iterations-to-skip", [str(i) for i in skip])
    extra["argv"] = list(command.with_host_args(host).argv)
    extra["restarts"] += 1
    extra.setdefault("rollbacks", []).append({"spike": spike, "rule": rule, "to": ckpt,
                                              "skipped": [ckpt + 1, spike]})
    extra["handled"] = launch.index
    state.save()


# ---------------------------------------------------------------------------------------- mechmon
@dataclass
class StudySupervisor(Supervisor):
    """The supervisor's own loop and decisions; its launch is the study's resumable one."""

    state: LaunchState = field(default_factory=lambda: LaunchState(""))

    def run(self) -> int:
        # No signal forwarding here: the study turns SIGTERM into SystemExit, and the resumable
        # launch stops its own process group on the way out (then the next run resumes it).
        try:
            return self._loop()
        finally:
            self.notifier.close()

    def _launch(self) -> tuple[int, dict[str, int]]:
        self.launches += 1
        found = [launch for launch in self.state.launches if launch.index == self.launches]
        argv = list(self.command.argv)
        launch = found[0] if found else LaunchRecord(index=self.launches, argv=[], started=time.time(),
                                                     start_iteration=_start_iteration(argv))
        if not found:
            launch.argv = with_launch_outputs(argv, launch.metrics_path(self.state.directory))
        started = alert_files(self.config.save)
        run_launch(self.state, launch, self.config.save)
        return int(launch.returncode or 0), started

    def _record(self, record: RecoveryRecord) -> None:
        super()._record(record)
        e = self._episode
        self.state.extra["supervisor"] = {
            "launches": self.launches, "restarts": self.restarts, "command": list(self.command.argv),
            "episode": {"list_name": e.list_name, "index": e.index, "point": e.point},
            "done": record.action == "stop", "exit_code": record.exit_code, "initial": self._initial,
        }
        self.state.save()


def run_mechmon(directory: str, argv: list[str], ckpt_dir: str, tensorboard: Optional[str] = None) -> LaunchState:
    state = LaunchState.load(directory)
    saved = state.extra.get("supervisor", {})
    if saved.get("done"):
        return state
    command = parse_command(saved.get("command") or argv)
    host = read_host_flags(command.help_argv)
    policy = resolve_policy(load_policy("default"), host)
    config = SupervisorConfig(save=ckpt_dir)
    sup = StudySupervisor(command=command, config=config, policy=policy, host=host,
                          log=RecoveryLog(ckpt_dir, tensorboard), notifier=Notifier(None), state=state)
    if saved:
        sup.launches, sup.restarts = saved["launches"], saved["restarts"]
        sup._episode = _Episode(**saved["episode"])
        sup._initial = saved.get("initial")
    code = sup.run()
    if code == 0 and not state.extra.get("supervisor", {}).get("done"):  # no restart: no stop record
        state.extra["supervisor"] = {"launches": sup.launches, "restarts": sup.restarts,
                                     "command": list(sup.command.argv), "done": True, "exit_code": 0,
                                     "episode": {"list_name": None, "index": -1, "point": None}}
        state.save()
    return state


def without_mechmon(argv: list[str]) -> list[str]:
    """The command with every ``--mechmon*`` flag removed (today's practice runs no monitor)."""
    command = parse_command(argv)
    host = command.host_args
    for flag in [a for a in host if a.startswith("--mechmon")]:
        host = remove_flag(host, flag)
    return list(command.with_host_args(host).argv)


def recovery_records(ckpt_dir: str) -> list[dict]:
    import json

    path = os.path.join(ckpt_dir, "mechmon_recovery.jsonl")
    if not os.path.exists(path):
        return []
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]
