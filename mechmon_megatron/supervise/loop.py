"""The supervisor loop: launch, wait, read the alert, roll back, remedy, relaunch, or stop."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from dataclasses import dataclass, field
from typing import Optional

from mechmon_megatron.supervise.alerts import AlertError, AlertInfo, alert_files, new_alert_path, read_alert
from mechmon_megatron.supervise.checkpoints import (
    Checkpoint,
    Selection,
    fingerprint,
    fingerprints,
    keep_aside,
    latest_checkpoint,
    list_checkpoints,
    select_rollback,
)
from mechmon_megatron.supervise.command import LaunchCommand, flag_values, remove_flag, set_flag
from mechmon_megatron.supervise.host import HostFlags
from mechmon_megatron.supervise.notify import Notifier
from mechmon_megatron.supervise.policy import ResolvedPolicy
from mechmon_megatron.supervise.records import RecoveryLog, RecoveryRecord
from mechmon_megatron.supervise.remedy import apply_edit, diff_flags, let_flags_set_schedule, select_checkpoint_flags


@dataclass(frozen=True, kw_only=True)
class SupervisorConfig:
    save: str
    """The command's ``--save`` folder (checkpoints, the alert, mechmon_recovery.jsonl)."""
    abort_code: int = 42
    """The command's ``--mechmon-exit-code``."""
    max_restarts: int = 3
    """Relaunches at most, over the whole run."""
    window: int = 1000
    """Steps: an alarm of the same remedy list within this many steps of the last relaunch
    point escalates to the list's next remedy (later: the list starts over)."""
    select_flag: Optional[str] = "--ckpt-step"
    """The host's flag that loads a given checkpoint from ``--load`` (None: the host has none)."""


@dataclass
class _Episode:
    """The last relaunch: its remedy list, remedy index and rollback iteration."""

    list_name: Optional[str] = None
    index: int = -1
    point: Optional[int] = None


@dataclass
class Supervisor:
    command: LaunchCommand
    config: SupervisorConfig
    policy: ResolvedPolicy
    host: HostFlags
    log: RecoveryLog
    notifier: Notifier
    launches: int = 0
    restarts: int = 0
    started: float = field(default_factory=time.time)
    _child: Optional[subprocess.Popen] = None
    _signal: Optional[int] = None
    _episode: _Episode = field(default_factory=_Episode)
    _initial: Optional[list[str]] = None
    """The first launch's host flags: its own start (``--load`` / the selection flag, or none)."""
    _resumed: Optional[Checkpoint] = None
    """What the first launch resumed without a selection flag: the latest checkpoint in its
    ``--load`` folder just before it started (None: it started fresh, or chose one by flag)."""
    _before: dict[str, int] = field(default_factory=dict)
    """The checkpoints ``--save`` held before the first launch -> their fingerprints: another run's
    (or this job's older history), never a rollback point unless this run rewrote them."""

    # ------------------------------------------------------------------ process
    def _forward(self, signum: int, _frame) -> None:
        """SIGTERM/SIGINT: pass to the child's process group (the launcher and its ranks)."""
        self._signal = signum
        if self._child is not None and self._child.poll() is None:
            try:
                os.killpg(self._child.pid, signum)
            except ProcessLookupError:
                pass

    def _launch(self) -> tuple[int, dict[str, int]]:
        """Run the command to its end; (exit code, the alert files there were before it)."""
        self.launches += 1
        started = alert_files(self.config.save)
        # Own process group: a signal reaches every process the launcher started, and the
        # terminal's Ctrl-C reaches the supervisor, which passes it on once.
        self._child = subprocess.Popen(list(self.command.argv), start_new_session=True)
        code = self._child.wait()  # signals arrive in _forward; wait() resumes after them (PEP 475)
        self._child = None
        return code, started

    # ------------------------------------------------------------------ decisions
    def _record(self, record: RecoveryRecord) -> None:
        record.elapsed_s = round(time.time() - self.started, 3)
        self.log.append(record)
        self.notifier.record(record)

    def _stop(self, reason: str, code: Optional[int], **extra) -> int:
        self._record(RecoveryRecord(action="stop", reason=reason, launch=self.launches, exit_code=code,
                                    restarts=self.restarts, command=list(self.command.argv), **extra))
        if code is not None and code < 0:  # killed by a signal: the shell's convention
            return 128 - code
        return code if code else 2

    def _remember_start(self) -> None:
        """Before the first launch: its flags, and what its ``--load`` would resume (the latest
        checkpoint there now: with ``--load`` = ``--save`` the later saves replace it as latest)."""
        self._initial = list(self.command.host_args)
        load = flag_values(self._initial, "--load")
        chosen = flag_values(self._initial, self.config.select_flag) if self.config.select_flag else None
        if load and not chosen:
            self._resumed = latest_checkpoint(load[0])
        self._before = fingerprints(self.config.save)
        others = [c.name for c in list_checkpoints(self.config.save) if not self._is_own_start(c)]
        if others:
            names = ", ".join(others)
            print(f"[mechmon-supervise] --save {self.config.save} already holds {names}: not this run's, never a "
                  "rollback point (the command's own --load start excepted)", flush=True)

    def _this_runs(self, ckpt: Checkpoint) -> bool:
        """Saved by this run (absent before the first launch, or rewritten since), or the command's
        own start in ``--save`` (what its ``--load`` resumed, or named by the selection flag)."""
        before = self._before.get(ckpt.path)
        return before is None or before != fingerprint(ckpt) or self._is_own_start(ckpt)

    def _is_own_start(self, ckpt: Checkpoint) -> bool:
        if self._resumed is not None:
            return os.path.realpath(self._resumed.path) == os.path.realpath(ckpt.path)
        initial = self._initial or []
        load = flag_values(initial, "--load")
        chosen = flag_values(initial, self.config.select_flag) if self.config.select_flag else None
        if not load or not chosen or os.path.realpath(load[0]) != os.path.realpath(self.config.save):
            return False
        return chosen[0] in (ckpt.name, str(ckpt.iteration))

    def _keep_abort_checkpoint(self, alert: AlertInfo) -> dict:
        """Move the alarm's checkpoint (with its alert) aside before the relaunch can overwrite it."""
        folder = os.path.dirname(os.path.abspath(alert.path))
        if os.path.realpath(folder) == os.path.realpath(self.config.save):
            folder = alert.path  # no checkpoint folder: keep the alert file itself
        kept = keep_aside(self.config.save, folder, self.launches)
        return {"from": folder, "to": kept, "iteration": alert.iteration}

    def _start_iteration(self) -> int:
        """Iterations done at the first launch's own start (its selection flag with --load, or the
        checkpoint its --load resumed, else 0)."""
        initial = self._initial or []
        step = flag_values(initial, self.config.select_flag) if self.config.select_flag else None
        if step and flag_values(initial, "--load") and step[0].isdigit():
            return int(step[0])
        return self._resumed.iteration if self._resumed else 0

    def _start_flags(self, args: list[str], select_flag: Optional[str]) -> tuple[Optional[list[str]], str]:
        """``args`` set to load what the first launch loaded; (None, why) when the host cannot."""
        initial = self._initial or []
        load = flag_values(initial, "--load")
        chosen = flag_values(initial, select_flag) if select_flag else None
        for flag in ("--load", *([select_flag] if select_flag else [])):
            original = flag_values(initial, flag)
            args = remove_flag(args, flag) if original is None else set_flag(args, flag, original)
        same_folder = bool(load) and os.path.realpath((load or [''])[0]) == os.path.realpath(self.config.save)
        if not same_folder or chosen:
            return args, ""
        # --load is the --save folder: its latest checkpoint is now a later save, not the start.
        if self._resumed is None:
            return remove_flag(args, "--load"), ("--load dropped: the first launch found no checkpoint in it (= "
                                                  "--save) and started fresh; it now holds later saves")
        if select_flag is None:
            return None, (f"the command's own start is {self._resumed.name} in --load (= --save), which is no longer "
                          f"its latest, and the host has no {self.config.select_flag} to load it")
        value = str(self._resumed.iteration) if self._resumed.layout == "megatron" else self._resumed.name
        return set_flag(args, select_flag, [value]), f"the command's own start: {self._resumed.name}, by {select_flag}"

    def run(self) -> int:
        previous = {s: signal.signal(s, self._forward) for s in (signal.SIGTERM, signal.SIGINT)}
        try:
            return self._loop()
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)
            self.notifier.close()

    def _loop(self) -> int:
        while True:
            if self._signal is not None:  # arrived between two launches: do not start another
                return self._stop(f"stopped by signal {signal.Signals(self._signal).name} before a relaunch",
                                  128 + self._signal)
            if self.launches == 0:
                self._remember_start()
            code, started = self._launch()
            if self._signal is not None:
                return self._stop(f"stopped by signal {signal.Signals(self._signal).name} (passed to the command)",
                                  code if code else 128 + self._signal)
            if code == 0:
                if self.restarts:
                    self._record(RecoveryRecord(action="stop", reason="the command finished (exit 0)",
                                                launch=self.launches, exit_code=0, restarts=self.restarts,
                                                command=list(self.command.argv)))
                return 0
            # torchrun exits 1 when a worker fails, whatever the worker's code: a fresh alert then
            # tells a mechmon abort from a crash.
            fresh = new_alert_path(self.config.save, started)
            if code != self.config.abort_code and fresh is None:
                which = "the relaunch" if self.restarts else "the command"
                return self._stop(f"{which} failed with exit code {code}, not a mechmon abort (code "
                                  f"{self.config.abort_code}, or a fresh alert under a launcher): not relaunched", code)
            try:
                alert = read_alert(self.config.save, started)
            except AlertError as exc:
                return self._stop(str(exc), code)
            outcome = self._relaunch(alert, code)
            if outcome is not None:
                return outcome

    def _relaunch(self, alert: AlertInfo, code: int) -> Optional[int]:
        """Prepare the next launch (and record it), or stop: returns the exit code then."""
        info = alert.to_json()
        if self.restarts >= self.config.max_restarts:
            return self._stop(f"{self.restarts} restarts done, the most --max-restarts allows", code, alert=info)
        list_name, remedies = self.policy.remedy_list(alert.family)
        if list_name is None:
            known = alert.family in self.policy.policy.families
            why = "stops on it" if known else "has no remedy for it"
            return self._stop(f"{alert.family} alarm: the policy ({self.policy.policy.source}) {why}", code, alert=info)
        episode = self._episode
        again = (episode.list_name == list_name and episode.point is not None
                 and alert.iteration - episode.point <= self.config.window)
        index = episode.index + 1 if again else 0
        if index >= len(remedies):
            tried = ", ".join(r.remedy.name for r in remedies) or "none usable on this host"
            return self._stop(f"{alert.family} alarmed again at iteration {alert.iteration}, within "
                              f"{self.config.window} steps of the relaunch from {episode.point}: every {list_name} "
                              f"remedy tried ({tried})", code, alert=info)
        before = self.command.host_args
        # The same list again after a relaunch from episode.point: that point evidently holds part
        # of the fault (the remedy was applied from there and the family alarmed again), so the
        # rollback goes at least one save further back; with none older, to the command's own start.
        # The command's own start is a rollback point too: with no checkpoint at or before the change
        # point, it is the one that is (an alarm whose drift may predate every save: the limit rule).
        limit = alert.change_point
        if again and episode.point is not None:
            limit = min(limit, episode.point - 1)
        found = list_checkpoints(self.config.save)
        checkpoints = [c for c in found if self._this_runs(c)]
        foreign = [c.name for c in found if not self._this_runs(c) and c.iteration < alert.iteration]
        selection = select_rollback(checkpoints, limit, alert.iteration)
        no_older = not any(c.iteration <= limit for c in checkpoints)
        if no_older and again and episode.point is not None:
            after = self._start_iteration() > alert.change_point
            selection = Selection(None, after, f"{alert.family} alarmed again after the relaunch from iteration "
                                               f"{episode.point}: that point holds part of the fault, and no "
                                               "checkpoint is older: from the command's own start"
                                               + (" (saved AFTER the change point)" if after else ""))
        elif no_older and self._start_iteration() <= limit:
            selection = Selection(None, False, f"no checkpoint at or before the change point (step {limit}); the "
                                               f"command's own start (iteration {self._start_iteration()}) is: "
                                               "from the command's own start")
        elif selection.checkpoint is None:
            return self._stop(selection.why, code, alert=info, why=selection.why)
        elif limit < alert.change_point and not selection.after_change_point:
            why = f"{selection.why}: older than the last rollback point ({episode.point}), which alarmed again"
            selection = Selection(selection.checkpoint, False, why)
        start_iteration = selection.checkpoint.iteration if selection.checkpoint else self._start_iteration()
        skip = range(start_iteration + 1, alert.iteration + 1)
        # A remedy that changes no flag (already in effect) would relaunch the run that alarmed:
        # go on to the next one of the list, and say so in the record.
        passed: list[str] = []
        applied = apply_edit(before, remedies[index].edit, skip_window=list(skip))
        while not (applied.added or applied.removed) and index + 1 < len(remedies):
            passed.append(f"remedy {remedies[index].remedy.name} changes nothing here ({'; '.join(applied.notes)}): "
                          "passed over")
            index += 1
            applied = apply_edit(before, remedies[index].edit, skip_window=list(skip))
        if not (applied.added or applied.removed):
            return self._stop(f"{alert.family} alarm at iteration {alert.iteration}: the remaining {list_name} "
                              f"remedies change no flag of the command ({'; '.join(applied.notes)})", code, alert=info)
        chosen = remedies[index]
        schedule_args, schedule_note = let_flags_set_schedule(applied.args, [*applied.added, *applied.removed],
                                                             self.host)
        applied.args = schedule_args
        wanted = self.config.select_flag
        select_flag = wanted if (wanted and self.host.has(wanted)) else None
        ckpt = selection.checkpoint
        start_note = ""
        if ckpt is None:  # from the start: what the first launch loaded (its --load, selection flag), or none
            args, start_note = self._start_flags(list(applied.args), select_flag)
            if args is None:
                return self._stop(start_note, code, alert=info, why=selection.why)
            where = {"name": "start", "iteration": start_iteration, "path": None, "layout": "start"}
        else:
            latest = latest_checkpoint(self.config.save)
            if select_flag is None and (latest is None or latest.path != ckpt.path):
                return self._stop(f"the host has no {wanted} to load {ckpt.name}, and the supervisor never "
                                  f"rewrites the tracker file (latest is {latest.name if latest else 'none'})", code,
                                  alert=info, why=selection.why)
            value = str(ckpt.iteration) if ckpt.layout == "megatron" else ckpt.name
            args = select_checkpoint_flags(applied.args, self.config.save, select_flag, value)
            where = {"name": ckpt.name, "iteration": ckpt.iteration, "path": ckpt.path, "layout": ckpt.layout}
        try:
            kept = self._keep_abort_checkpoint(alert)
        except OSError as exc:
            return self._stop(f"cannot keep the abort checkpoint of iteration {alert.iteration} aside ({exc}): not "
                              "relaunched, since the relaunch could overwrite it", code, alert=info, why=selection.why)
        self.command = self.command.with_host_args(args)
        self.restarts += 1
        self._episode = _Episode(list_name=list_name, index=index, point=start_iteration)
        removed, added = diff_flags(before, args)
        self._record(RecoveryRecord(
            action="relaunch", launch=self.launches, exit_code=code, restarts=self.restarts, alert=info,
            reason=(f"{alert.family} alarm at iteration {alert.iteration} (change point {alert.change_point}); "
                    f"remedy {index + 1}/{len(remedies)} of {list_name}"),
            checkpoint=where, aborted=kept,
            after_change_point=selection.after_change_point, why=selection.why, remedy=chosen.remedy.name,
            flags_removed=removed, flags_added=added,
            notes=[*passed, *applied.notes, *([schedule_note] if schedule_note else []),
                   *([start_note] if start_note else []),
                   *([f"left alone, not this run's: {', '.join(foreign)} (in --save before the first launch)"]
                     if foreign else [])],
            command=list(self.command.argv)))
        return None
