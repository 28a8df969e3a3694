"""``mechmon-supervise [--policy FILE|default] [--max-restarts M] [--window STEPS] [--webhook URL] -- COMMAND...``

Exit status: 0 when the command finally succeeds; the command's last exit code when the
supervisor stops (remedies exhausted, --max-restarts reached, a crash that is not a mechmon
abort, an unusable alert or checkpoint); 2 for a bad option or policy, before any launch.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import Optional, Sequence

from mechmon_megatron.session.rollback_reach import (
    DEFAULT_DELTA,
    DEFAULT_INTERVAL,
    RETENTION_FLAGS,
    missing_saves_notice,
    reach_notice,
)
from mechmon_megatron.session.webhook import check_webhook_url
from mechmon_megatron.supervise.command import CommandError, LaunchCommand, flag_values, parse_command
from mechmon_megatron.supervise.host import HostError, HostFlags, read_host_flags
from mechmon_megatron.supervise.loop import Supervisor, SupervisorConfig
from mechmon_megatron.supervise.notify import Notifier
from mechmon_megatron.supervise.policy import PolicyError, ResolvedPolicy, load_policy, resolve_policy
from mechmon_megatron.supervise.records import RecoveryLog, RecoveryRecord
from mechmon_megatron.supervise.remedy import SCHEDULE_OVERRIDE, is_schedule_flag

PROG = "mechmon-supervise"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG, allow_abbrev=False,
        description="Run a training command; after a mechmon abort, roll back to the newest checkpoint at or "
                    "before the detector's change point, apply the policy's remedy and relaunch (docs/RECOVERY.md).",
        usage=f"{PROG} [options] -- COMMAND...")
    parser.add_argument("--policy", default="default", help="Policy JSON file, or 'default' (the shipped one).")
    parser.add_argument("--max-restarts", type=int, default=3, help="Relaunches at most (default 3).")
    parser.add_argument("--window", type=int, default=1000,
                        help="Steps: the same family alarming within this many steps of the last relaunch point "
                             "gets the next remedy of its list (default 1000).")
    parser.add_argument("--webhook", default=None, help="http(s) URL: each action is posted as Slack-compatible JSON.")
    parser.add_argument("--select-flag", default="--ckpt-step",
                        help="The host's flag that loads one checkpoint from --load: the iteration (Megatron "
                             "layout) or the tag (DeepSpeed), e.g. --select-flag=--ckpt-tag or --select-flag "
                             "ckpt-tag (default --ckpt-step).")
    return parser


def _fail(message: str, save: Optional[str] = None, command: Sequence[str] = ()) -> int:
    """One line on stderr, a stop record when there is a --save folder, exit 2."""
    if save:
        RecoveryLog(save).append(RecoveryRecord(action="stop", reason=message, launch=0, exit_code=None, restarts=0,
                                                command=list(command)))
    else:
        print(f"{PROG}: error: {message}", file=sys.stderr)
    return 2


def _split(argv: Sequence[str]) -> tuple[list[str], list[str]]:
    argv = list(argv)
    if "--" not in argv:
        return argv, []
    k = argv.index("--")
    return argv[:k], argv[k + 1:]


def _command_settings(command: LaunchCommand) -> tuple[Optional[str], int, Optional[str]]:
    """(--save, --mechmon-exit-code, --tensorboard-dir) from the host's own flags."""
    host = command.host_args
    save = flag_values(host, "--save") or []
    code = flag_values(host, "--mechmon-exit-code") or ["42"]
    tensorboard = flag_values(host, "--tensorboard-dir") or []
    return (save[0] if save else None), int(code[0]), (tensorboard[0] if tensorboard else None)


def reachability_notices(host_args: Sequence[str]) -> list[str]:
    """Lines that say, before the first launch, when a rollback cannot work as intended."""
    notices = []
    action = flag_values(host_args, "--mechmon-action") or []
    if flag_values(host_args, "--mechmon") is None or action != ["checkpoint-and-abort"]:
        notices.append("the command does not set --mechmon --mechmon-action checkpoint-and-abort: an alarm will not "
                       "stop it, so there is nothing to recover (the supervisor only passes its exit through)")
    save_interval = _int_flag(host_args, "--save-interval", 0)  # absent, 0 or "None": no scheduled saves
    save = flag_values(host_args, "--save") or []
    line = missing_saves_notice(save[0] if save else None, save_interval,
                                max(1, _int_flag(host_args, "--mechmon-interval", DEFAULT_INTERVAL)),
                                max(1, _int_flag(host_args, "--mechmon-delta", DEFAULT_DELTA)))
    if line is None:
        line = _retention_notice(host_args, save_interval)
    if line:
        notices.append(f"the command: {line}")
    return notices


def _int_flag(host_args: Sequence[str], flag: str, default: int) -> int:
    values = flag_values(host_args, flag) or []
    try:
        return int(values[0]) if values else default
    except ValueError:
        return default  # the host's parser says so at the launch


def _retention_notice(host_args: Sequence[str], save_interval: int) -> Optional[str]:
    """The reach line when a retention flag of the host keeps too few saves (rollback_reach)."""
    interval = _int_flag(host_args, "--mechmon-interval", DEFAULT_INTERVAL)
    delta = _int_flag(host_args, "--mechmon-delta", DEFAULT_DELTA)
    for flag in RETENTION_FLAGS:
        keep = _int_flag(host_args, flag, -1)
        if keep >= 0:
            return reach_notice(save_interval, keep, flag, max(1, interval), max(1, delta))
    return None


def schedule_notices(policy: ResolvedPolicy, host: HostFlags) -> list[str]:
    """A line for each remedy that changes the LR schedule on a host without the override switch:
    after a rollback to a checkpoint, that checkpoint's schedule would win over the new flags."""
    if host.has(SCHEDULE_OVERRIDE):
        return []
    notices = []
    for list_name, chosen in policy.lists.items():
        for item in chosen:
            touched = [f for f in item.edit.flags() if is_schedule_flag(f)]
            if touched:
                notices.append(f"remedy {list_name}/{item.remedy.name} changes {', '.join(touched)}, and the host has "
                               f"no {SCHEDULE_OVERRIDE}: after a rollback to a checkpoint its saved LR schedule may "
                               "win (the relaunch from the command's own start is unaffected)")
    return notices


def _save_folder_problem(save: str) -> Optional[str]:
    """Why ``save`` cannot be the checkpoint folder (a file, or not creatable), or None. Creates it."""
    if os.path.exists(save) and not os.path.isdir(save):
        return f"--save {save} is a file, not a folder: the checkpoints, the alert and the records live in --save"
    try:
        os.makedirs(save, exist_ok=True)
    except OSError as exc:
        return f"--save {save} cannot be created ({exc.strerror or exc})"
    return None


def main(argv: Optional[Sequence[str]] = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    own, rest = _split(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args = parser.parse_args(own)
    if not rest:
        parser.error("no command: give it after --, e.g. mechmon-supervise -- python -m gpt_trainer --save ckpt ...")
    if args.max_restarts < 0:
        parser.error(f"--max-restarts must be >= 0, got {args.max_restarts}")
    if args.window < 0:
        parser.error(f"--window must be >= 0, got {args.window}")
    if args.webhook:
        try:
            check_webhook_url(args.webhook)
        except ValueError as exc:
            parser.error(f"--webhook {exc}")
    try:
        command = parse_command(rest)
        save, abort_code, tensorboard = _command_settings(command)
    except (CommandError, ValueError) as exc:
        return _fail(f"cannot read the command: {exc}")
    if not save:
        return _fail("the command has no --save: the supervisor finds checkpoints and the alert there")
    save = os.path.abspath(save)
    problem = _save_folder_problem(save)
    if problem:
        return _fail(problem)
    try:
        policy = load_policy(args.policy)
        host: HostFlags = read_host_flags(command.help_argv)
        resolved = resolve_policy(policy, host, command_flags={a.split("=", 1)[0] for a in command.host_args
                                                               if a.startswith("--")})
    except (PolicyError, HostError) as exc:
        return _fail(str(exc), save, rest)
    if args.select_flag and not args.select_flag.startswith("--"):
        args.select_flag = "--" + args.select_flag
    for notice in [*reachability_notices(command.host_args), *resolved.notices, *schedule_notices(resolved, host)]:
        print(f"[{PROG}] {notice}", flush=True)
    if args.select_flag and not host.has(args.select_flag):
        print(f"[{PROG}] the host has no {args.select_flag}: a rollback can only resume its latest checkpoint",
              flush=True)
    config = SupervisorConfig(save=save, abort_code=abort_code, max_restarts=args.max_restarts, window=args.window,
                              select_flag=args.select_flag or None)
    supervisor = Supervisor(command=command, config=config, policy=resolved, host=host,
                            log=RecoveryLog(save, tensorboard), notifier=Notifier(args.webhook))
    return supervisor.run()
