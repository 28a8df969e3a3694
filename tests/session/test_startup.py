"""Every bad input refused at start-up (one line naming the flag or file, exit 2), on every
host, before any process group or model exists; the monitors never go quiet silently.

One section per kind of bad input that concerns the flags (the scan's bad input is
tests/scan/test_scan_bad_input.py, the patch tool's tests/megatron_lm/test_patch_tool.py).
In process: the trainer's and Megatron-LM's parsers with the ``--mechmon*`` flags, the same
``validate_mechmon_args`` they call when they parse; the DeepSpeed section parser; the session on
plain tensors. One launch checks that the trainer's real entry point exits 2 without a traceback.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mechmon_megatron.cli.args import add_mechmon_args, validate_mechmon_args
from mechmon_megatron.detect.families import family_spec
from mechmon_megatron.detect.null_model import _TAIL_FILE
from mechmon_megatron.session import names
from mechmon_megatron.session.config import MechmonConfig
from mechmon_megatron.session.host import AttentionSite, QKWeights, SnapshotBudget
from mechmon_megatron.session.session import MechmonStrictError, MonitoringSession
from mechmon_megatron.session.writers import TensorBoardScalarWriter, WriterGroup

REPO = Path(__file__).resolve().parents[2]


def trainer_parser() -> argparse.ArgumentParser:
    """The example trainer's parser with the mechmon flags (what ``gpt_trainer.monitored.run`` builds)."""
    from gpt_trainer.args import build_parser

    return build_parser([add_mechmon_args])


def megatron_parser() -> argparse.ArgumentParser:
    """The flags of Megatron-LM's that the start-up check reads, with ours (as ``mechmon-run`` adds them)."""
    parser = argparse.ArgumentParser(prog="pretrain_gpt.py")
    parser.add_argument("--train-iters", type=int, default=None)
    parser.add_argument("--save", default=None)
    parser.add_argument("--num-layers", type=int, default=None)
    return add_mechmon_args(parser)


def refused(parser: argparse.ArgumentParser, argv: list[str], capsys) -> str:
    """The error line of a refused command line (exit status 2), as the host's parser prints it."""
    with pytest.raises(SystemExit) as info:
        validate_mechmon_args(parser, parser.parse_args(["--mechmon", *argv]))
    assert info.value.code == 2
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if "error:" in line]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def accepted(parser: argparse.ArgumentParser, argv: list[str]) -> MechmonConfig:
    return validate_mechmon_args(parser, parser.parse_args(["--mechmon", *argv]))


def shipped_table() -> dict:
    return json.loads(Path(_TAIL_FILE).read_text())


def calibration(tmp_path: Path, name: str, content) -> str:
    path = tmp_path / name
    path.write_text(content if isinstance(content, str) else json.dumps(content))
    return str(path)


def with_tail(field: str, value, overlap: str = "1") -> dict:
    table = shipped_table()
    table["tails"][overlap]["attn_delta2"]["layer"][field] = value
    return table


# ---------------------------------------------------------------------------- a tail that divides by 0
@pytest.mark.parametrize(
    "table, expected",
    [
        (with_tail("theta", 0), r"theta must be a finite number > 0"),
        (with_tail("theta", "fast"), r"theta must be a finite number > 0 .*, got 'fast'"),
        (with_tail("theta", -1.0), r"theta must be a finite number > 0"),
        (with_tail("theta", float("nan")), r"theta must be a finite number > 0"),
        ({"tails": {"0": shipped_table()["tails"]["1"]}}, r"overlap key '0' must be a positive integer"),
        ({"tails": {"-3": shipped_table()["tails"]["1"]}}, r"overlap key '-3' must be a positive integer"),
        ({"tails": {"1": {**shipped_table()["tails"]["1"], "attn_delta": {}}}}, r"unknown family 'attn_delta'"),
    ],
    ids=["theta-0", "theta-string", "theta-negative", "theta-nan", "overlap-0", "overlap-negative", "family"],
)
def test_calibration_with_a_bad_tail_is_refused_naming_flag_and_file(tmp_path, capsys, table, expected):
    import re

    path = calibration(tmp_path, "tails.json", table)  # NaN is written as the JSON extension NaN
    for parser in (trainer_parser(), megatron_parser()):
        line = refused(parser, ["--mechmon-detector-calibration", path], capsys)
        assert "--mechmon-detector-calibration" in line and path in line and re.search(expected, line), line


def test_the_session_itself_refuses_a_zero_theta(tmp_path):
    """A host that builds the config itself (DeepSpeed, a library user) meets the same check at start-up
    (naming the setting as the library user wrote it: the field)."""
    path = calibration(tmp_path, "tails.json", with_tail("theta", 0))
    with pytest.raises(ValueError, match=r"^detector_calibration: .*theta must be a finite number > 0"):
        MonitoringSession(MechmonConfig(enabled=True, interval=5, delta=5, detector_calibration=path),
                          [Toy(1).site()], writer=WriterGroup())


# ---------------------------------------------------------------------------- a rate no threshold fits
def test_false_alarm_rate_1e6_is_refused_by_the_trainer_and_megatron_lm(capsys):
    line = refused(trainer_parser(), ["--mechmon-false-alarm-rate", "1e6"], capsys)
    assert "--mechmon-false-alarm-rate 1e+06" in line
    # Megatron-LM at interval 5, where the old code built thresholds of 0.0.
    line = refused(megatron_parser(), ["--num-layers", "2", "--mechmon-interval", "5",
                                       "--mechmon-false-alarm-rate", "1e6"], capsys)
    assert "--mechmon-false-alarm-rate 1e+06 is beyond the measured null tails" in line and "use a rate below" in line


def test_the_usual_rates_are_accepted():
    for rate in ("0.001", "0.01", "1", "100"):
        assert accepted(trainer_parser(), ["--mechmon-false-alarm-rate", rate]).false_alarm_rate == float(rate)


def test_start_up_sets_no_thresholds_and_what_it_accepts_gets_them(monkeypatch):
    """The start-up check judges the rate from the per-test probability and the tails' floors; the
    session sets the thresholds once, from the job's real shape (``build_detector``): what start-up
    accepts, ``thresholds_for_job`` turns into thresholds."""
    from mechmon_megatron.detect import null_model
    from mechmon_megatron.session import detector_setup
    from mechmon_megatron.session.detector_setup import job_shape, load_detector_design
    from mechmon_megatron.session.startup import RunFacts, validate_startup

    def not_at_start_up(*args, **kwargs):
        raise AssertionError("start-up computed thresholds")

    monkeypatch.setattr(null_model, "thresholds_for_job", not_at_start_up)
    monkeypatch.setattr(detector_setup, "thresholds_for_job", not_at_start_up)
    cases = []
    for interval in (1, 5, 100):
        for rate in (1e-3, 1.0, 100.0, 1e4, 1e6):
            for shewhart in (False, True):
                config = MechmonConfig(enabled=True, interval=interval, delta=5 * interval, false_alarm_rate=rate,
                                       detector_shewhart=shewhart)
                try:
                    validate_startup(config, RunFacts(num_layers=2))
                except ValueError:
                    continue
                cases.append(config)
    monkeypatch.undo()
    assert len(cases) > 10
    for config in cases:
        design, table = load_detector_design(config)
        for layers in ({"attn": [1, 2], "router": []}, {"attn": [1, 2, 3], "router": [1, 2, 3]}):
            shape = job_shape(config, [{f: layers[family_spec(f).monitor] for f in ("attn_delta2", "attn_dw",
                                                                               "router_entropy", "router_weights")
                                        if layers[family_spec(f).monitor]}])
            null_model.thresholds_for_job(shape, config.false_alarm_rate, table, shewhart=design.shewhart)


def test_a_tail_too_flat_for_a_finite_threshold_is_refused_at_start_up(tmp_path, capsys):
    """A theta of 1e-310 is finite and > 0, yet no finite threshold gives a small probability: the
    calibration is refused at start-up (``NullTail.bounded``), not when the session sets thresholds."""
    path = calibration(tmp_path, "tails.json", with_tail("theta", 1e-310))
    line = refused(megatron_parser(), ["--mechmon-detector-calibration", path], capsys)
    assert f"--mechmon-detector-calibration: no usable null-tail table in {path}: the tail of 'attn_delta2' " in line
    assert "too small for a finite threshold" in line, line


def test_a_routing_floor_above_the_experts_is_refused_at_parse_time(capsys):
    parser = megatron_parser()
    parser.add_argument("--num-experts", type=int, default=None)
    parser.add_argument("--moe-router-topk", type=int, default=2)
    line = refused(parser, ["--num-experts", "4", "--mechmon-router-min-effective-experts", "6"], capsys)
    assert line.endswith("error: --mechmon-router-min-effective-experts is 6, more than the 4 experts of the router "
                         "(the most exp(entropy) can be)"), line
    assert accepted(parser, ["--num-experts", "4", "--mechmon-router-min-effective-experts", "3"])
    assert accepted(parser, ["--num-experts", "4", "--mechmon-monitors", "attn",
                             "--mechmon-router-min-effective-experts", "6"])  # no router monitors: nothing to judge


# ---------------------------------------------------------------------------- alpha inf
@pytest.mark.parametrize("alpha", ["inf", "-inf", "nan", "0", "-1"])
def test_alpha_must_be_finite_and_positive_in_the_trainer_and_the_scan(capsys, tmp_path, alpha):
    from mechmon_megatron.scan import ScanConfig, ScanInputError

    line = refused(trainer_parser(), [f"--mechmon-alpha={alpha}"], capsys)
    assert "--mechmon-alpha must be a finite number > 0" in line
    with pytest.raises(ScanInputError, match=r"^--alpha must be a finite number > 0"):
        ScanConfig(inputs=("x",), out=str(tmp_path / "out"), alpha=float(alpha))


# ---------------------------------------------------------------------------- no table at all
@pytest.mark.parametrize(
    "content, expected",
    [("", "empty file"), ("{", "not JSON"), ("[1,2,3]", "expected a JSON object"),
     ('{"tails":{}}', '"tails" is empty')],
    ids=["empty", "bad-json", "list", "no-tails"],
)
def test_calibration_that_is_no_table_is_refused_at_parse_time(tmp_path, capsys, content, expected):
    path = calibration(tmp_path, "tails.json", content)
    for parser in (trainer_parser(), megatron_parser()):
        line = refused(parser, ["--mechmon-detector-calibration", path], capsys)
        assert f"--mechmon-detector-calibration: no usable null-tail table in {path}: {expected}" in line, line


def test_deepspeed_section_refuses_a_calibration_that_is_no_table(tmp_path):
    from mechmon_megatron.adapters.deepspeed.config import parse_section

    path = calibration(tmp_path, "tails.json", '{"tails":{}}')
    with pytest.raises(ValueError, match=rf"^ds_config\.mechmon\.detector_calibration: .*{path}.*empty"):
        parse_section({"enabled": True, "detector_calibration": path})


# ---------------------------------------------------------------------------- abort without a save folder
def test_checkpoint_and_abort_needs_save(tmp_path, capsys):
    for parser in (trainer_parser(), megatron_parser()):
        line = refused(parser, ["--mechmon-action", "checkpoint-and-abort"], capsys)
        assert "--mechmon-action checkpoint-and-abort" in line and "--save is not set" in line
    line = refused(megatron_parser(), ["--mechmon-action", "checkpoint-and-abort", "--save", "/proc/ckpt"], capsys)
    assert "--save '/proc/ckpt' cannot be written" in line
    ok = accepted(trainer_parser(), ["--mechmon-action", "checkpoint-and-abort", "--save", str(tmp_path / "ckpt")])
    assert ok.action == "checkpoint-and-abort" and not (tmp_path / "ckpt").exists()  # checked, nothing made


def test_deepspeed_abort_needs_a_checkpoint_dir(tmp_path):
    from mechmon_megatron.adapters.deepspeed.config import parse_section

    with pytest.raises(ValueError, match=r"^ds_config\.mechmon\.action checkpoint-and-abort.*checkpoint_dir"):
        parse_section({"enabled": True, "action": "checkpoint-and-abort"})
    section = parse_section({"enabled": True, "action": "checkpoint-and-abort", "checkpoint_dir": str(tmp_path)})
    assert section.action == "checkpoint-and-abort"


# ---------------------------------------------------------------------------- a log dir that cannot be one
def test_log_dir_that_is_a_file_or_unwritable_is_refused(tmp_path, capsys):
    a_file = tmp_path / "file"
    a_file.write_text("x")
    line = refused(trainer_parser(), ["--mechmon-log-dir", str(a_file)], capsys)
    assert f"--mechmon-log-dir '{a_file}' exists and is not a directory" in line
    line = refused(megatron_parser(), ["--mechmon-log-dir", "/proc/x"], capsys)
    assert "--mechmon-log-dir '/proc/x' cannot be written" in line
    line = refused(megatron_parser(), ["--mechmon-log-dir", str(a_file / "sub")], capsys)
    assert f"cannot be created: {a_file} is not a directory" in line
    assert accepted(trainer_parser(), ["--mechmon-log-dir", str(tmp_path / "new" / "logs")])
    assert not (tmp_path / "new").exists() and os.listdir(tmp_path) == ["file"]  # the probe left nothing


# ---------------------------------------------------------------------------- nothing to check in the run
@pytest.mark.parametrize(
    "flags, expected",
    [
        (["--mechmon-delta", "1000", "--mechmon-interval", "10"], "the attention monitors will check nothing"),
        (["--mechmon-interval", "1000"], "--mechmon-interval 1000 > --train-iters 40: no check runs"),
        (["--mechmon-drill-at", "1000", "--mechmon-interval", "10"], "--mechmon-drill-at 1000 > --train-iters 40"),
    ],
    ids=["delta", "interval", "drill"],
)
def test_schedule_that_cannot_fit_the_run_is_warned_at_start_up(caplog, flags, expected):
    with caplog.at_level(logging.WARNING, logger="mechmon_megatron.cli.args"):
        accepted(trainer_parser(), ["--train-iters", "40", *flags])
    assert any(expected in r.getMessage() for r in caplog.records), caplog.text


def test_many_snapshot_sets_are_warned_with_their_memory(caplog):
    with caplog.at_level(logging.WARNING, logger="mechmon_megatron.cli.args"):
        accepted(trainer_parser(), ["--train-iters", "5000", "--mechmon-interval", "10", "--mechmon-delta", "1000",
                                    "--num-layers", "4", "--hidden-size", "256", "--num-attention-heads", "8"])
    # 4 layers x (256 + 256) Q/K rows x 256 x 4 bytes = 2 MiB per set, 100 sets.
    assert any("100 snapshot sets" in r.getMessage() and "about 200 MiB per rank (2.0 MiB each)" in r.getMessage()
               for r in caplog.records), caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="mechmon_megatron.cli.args"):
        accepted(trainer_parser(), ["--train-iters", "5000", "--mechmon-interval", "10", "--mechmon-delta", "20"])
    assert not caplog.records  # a healthy schedule says nothing


def test_the_session_warns_its_snapshot_memory_on_every_host(caplog):
    """DeepSpeed has no model shape at parse time: the session's own budget line (exact, per rank)
    is a warning when more than a few sets are held, an info line otherwise."""
    site = Toy(1).site()
    rows = (Toy.HEADS + Toy.GROUPS) * Toy.HEAD_DIM * Toy.HIDDEN
    site.snapshot_budget = SnapshotBudget(heads_elements=rows, full_elements=0, shared=False, element_size=4 * 128,
                                          device=torch.device("cpu"))  # 1/8 MiB per set
    with caplog.at_level(logging.INFO, logger="mechmon_megatron.session.session"):
        MonitoringSession(MechmonConfig(enabled=True, interval=2, delta=20), [site], writer=WriterGroup())
        MonitoringSession(MechmonConfig(enabled=True, interval=2, delta=4), [site], writer=WriterGroup())
    lines = [(r.levelno, r.getMessage()) for r in caplog.records if "snapshots hold" in r.getMessage()]
    assert lines[0][0] == logging.WARNING and "10 sets held at once" in lines[0][1] and "1.25 MiB" in lines[0][1]
    assert lines[1][0] == logging.INFO and "2 sets held at once" in lines[1][1]


# ---------------------------------------------------------------------------- never quiet silently
class Toy:
    HEADS, GROUPS, HEAD_DIM, HIDDEN = 2, 2, 4, 16

    def __init__(self, layer: int, seed: int = 0) -> None:
        self.gen = torch.Generator().manual_seed(seed)
        self.layer = layer
        self.wq = 0.02 * torch.randn(self.HEADS, self.HEAD_DIM, self.HIDDEN, generator=self.gen)
        self.wk = 0.02 * torch.randn(self.GROUPS, self.HEAD_DIM, self.HIDDEN, generator=self.gen)

    def step(self) -> None:
        self.wq += 1e-3 * torch.randn(self.wq.shape, generator=self.gen)
        self.wk += 1e-3 * torch.randn(self.wk.shape, generator=self.gen)

    def site(self, broken: bool = False) -> AttentionSite:
        # broken: K rows of another width than Q's, so every check's kernel fails (as a bad layout would)
        return AttentionSite(self.layer, read_heads=lambda: QKWeights(self.wq, self.wk[..., :3] if broken else self.wk,
                                                                      0), read_full=lambda: None)


def run_steps(session: MonitoringSession, toys: list[Toy], steps: int) -> None:
    session.on_train_start(0)
    for it in range(1, steps + 1):
        session.on_step_start(it)
        for toy in toys:
            toy.step()
        session.on_step_end(it)
    session.close()


def active_scalars(tb: Path) -> dict[int, float]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tb))
    acc.Reload()
    return {e.step: e.value for e in acc.Scalars(names.ACTIVE)}


def test_monitors_that_fail_at_every_check_say_so(tmp_path, caplog):
    toy = Toy(1)
    config = MechmonConfig(enabled=True, interval=2, delta=2)
    writer = WriterGroup([TensorBoardScalarWriter.in_directory(str(tmp_path / "tb"))])
    session = MonitoringSession(config, [toy.site(broken=True)], writer=writer)
    with caplog.at_level(logging.DEBUG, logger="mechmon_megatron.session"):
        run_steps(session, [toy], 50)  # 25 checks, each failing in its kernel
    assert active_scalars(tmp_path / "tb") == {step: 0.0 for step in range(2, 51, 2)}
    quiet = [r for r in caplog.records if r.levelno == logging.ERROR and "did not run at" in r.getMessage()]
    # One line per 10 checks (checks 1, 11 and 21 of the 25), naming the cause.
    assert [r.getMessage().split(" check(s)")[0][-2:].strip() for r in quiet] == ["1", "11", "21"]
    assert all("phase kernel, layer 1" in r.getMessage() and "NOT being watched" in r.getMessage() for r in quiet)
    tracebacks = [r for r in caplog.records if r.levelno == logging.ERROR and r.exc_info]
    assert len(tracebacks) == 1  # the cause with its traceback once, not at every check
    assert session.errors == 25

    healthy = Toy(1)
    writer = WriterGroup([TensorBoardScalarWriter.in_directory(str(tmp_path / "tb_ok"))])
    run_steps(MonitoringSession(config, [healthy.site()], writer=writer), [healthy], 10)
    assert active_scalars(tmp_path / "tb_ok") == {step: 1.0 for step in range(2, 11, 2)}


def test_a_detector_that_cannot_be_built_is_reported_not_silent(tmp_path, caplog):
    """A host that skips the start-up check (a library user building the config by hand) with a rate
    no threshold fits: the detector fails at every check; TensorBoard and the log say so."""
    toy = Toy(1)
    config = MechmonConfig(enabled=True, interval=5, delta=5, false_alarm_rate=1e6)
    writer = WriterGroup([TensorBoardScalarWriter.in_directory(str(tmp_path / "tb"))])
    with caplog.at_level(logging.ERROR, logger="mechmon_megatron.session"):
        run_steps(MonitoringSession(config, [toy.site()], writer=writer), [toy], 20)
    assert active_scalars(tmp_path / "tb") == {5: 0.0, 10: 0.0, 15: 0.0, 20: 0.0}
    quiet = [r.getMessage() for r in caplog.records if "did not run at" in r.getMessage()]
    assert len(quiet) == 1 and "phase decision" in quiet[0] and "false_alarm_rate 1e+06 asks each" in quiet[0]


def test_under_strict_a_monitor_that_cannot_run_stops_the_job():
    toy = Toy(1)
    config = MechmonConfig(enabled=True, interval=2, delta=2, strict=True)
    session = MonitoringSession(config, [toy.site(broken=True)], writer=WriterGroup())
    with pytest.raises(MechmonStrictError, match=r"iteration 2, phase kernel, layer 1"):
        run_steps(session, [toy], 4)


# ---------------------------------------------------------------------------- the entry points themselves
def _env() -> dict[str, str]:
    paths = [str(REPO), str(REPO / "examples" / "pretrain_scripts"), os.environ.get("PYTHONPATH", "")]
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(filter(None, paths)))


def test_trainer_refuses_a_bad_calibration_before_building_anything(tmp_path):
    """The example trainer as a user starts it: exit 2, one error line, no traceback, no model."""
    path = calibration(tmp_path, "tails.json", "[1,2,3]")
    proc = subprocess.run([sys.executable, "-m", "gpt_trainer", "--mechmon", "--mechmon-detector-calibration", path,
                           "--save", str(tmp_path / "ckpt")], cwd=REPO, env=_env(), capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr and proc.stderr.strip().splitlines()[-1].endswith(
        f"--mechmon-detector-calibration: no usable null-tail table in {path}: expected a JSON object "
        '{"tails": {overlap: {family: {level: tail}}}}, got list')
    assert not (tmp_path / "ckpt").exists()


def test_megatron_lm_refuses_a_bad_calibration_at_parse_time(tmp_path, capsys):
    """What mechmon-run and the patched script do with Megatron's parsed args (``run.validate_parsed``,
    called inside the wrapped ``parse_args``, before ``initialize_megatron`` makes a process group):
    exit 2 with Megatron-LM's short usage and one error line."""
    from mechmon_megatron.adapters.megatron_lm import run

    path = calibration(tmp_path, "tails.json", with_tail("theta", 0))
    args = megatron_parser().parse_args(["--train-iters", "3", "--mechmon", "--mechmon-detector-calibration", path])
    with pytest.raises(SystemExit) as info:
        run.validate_parsed(args)
    err = capsys.readouterr().err
    assert info.value.code == 2 and "Traceback" not in err
    assert err.splitlines()[-1] == (f"mechmon: error: --mechmon-detector-calibration: no usable null-tail table in "
                                    f"{path}: tails['1']['attn_delta2']['layer'].theta must be a finite number > 0 "
                                    "(the tail's decay rate), got 0")


def test_deepspeed_example_refuses_before_the_process_group(tmp_path, capsys, monkeypatch):
    """The DeepSpeed host as the example script runs it: the "mechmon" section is checked right
    after the flags are parsed, before deepspeed.init_distributed (exit 2, one line naming the key)."""
    monkeypatch.syspath_prepend(str(REPO / "examples" / "pretrain_scripts"))
    from deepspeed_moe_mechmon import main

    assert main(["--mechmon-set", 'action="checkpoint-and-abort"']) == 2  # no --save: no checkpoint_dir
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and ": error: ds_config.mechmon.action checkpoint-and-abort saves" in err, err
    assert "checkpoint_dir" in err and "Traceback" not in err
