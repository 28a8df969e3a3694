"""Property: over the flags and over calibration files, every configuration is either
refused at start-up (exit status 2, one line naming a ``--mechmon-`` flag) or it runs its checks
with ``mechmon/active`` = 1 -- never accepted and then silently unmonitored.

In process, as the hosts do it: the trainer's parser with the mechmon flags, the same
``validate_mechmon_args`` the trainer and Megatron-LM call when they parse, then (when accepted)
a real session on plain tensors for a few checks. A second property: the scan and the trainer
accept and refuse the same shared values.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import re
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from mechmon_megatron.cli.args import validate_mechmon_args
from mechmon_megatron.detect.null_model import _TAIL_FILE
from mechmon_megatron.session import names
from mechmon_megatron.session.config import MechmonConfig
from mechmon_megatron.session.host import AttentionSite, FullQK, QKWeights
from mechmon_megatron.session.session import MonitoringSession
from mechmon_megatron.session.writers import WriterGroup

SHIPPED = json.loads(Path(_TAIL_FILE).read_text())
HEADS, HEAD_DIM, HIDDEN = 2, 4, 8
ERROR = re.compile(r"^[\w.-]+: error: --mechmon-[a-z-]+\b[^\n]*$")

NUMBERS = st.one_of(
    st.sampled_from([0.0, -0.0, -1.0, 1e-300, 1e-3, 0.01, 1.0, 2.0, 100.0, 1e4, 1e6, 1e7]),
    st.floats(allow_nan=True, allow_infinity=True, width=32),
)
JUNK = st.one_of(NUMBERS, st.sampled_from(["fast", "", None, True, [], {}, 3, -2]))


@st.composite
def tail_tables(draw) -> object:
    """The shipped table, damaged or not in one of the ways a hand-edited or truncated file is."""
    table = json.loads(json.dumps(SHIPPED))
    tails = table["tails"]
    kind = draw(st.sampled_from(["keep", "field", "drop-field", "overlap-key", "family", "drop-family", "whole",
                                 "scale-theta"]))
    overlap = draw(st.sampled_from(sorted(tails)))
    family = draw(st.sampled_from(sorted(tails[overlap])))
    level = draw(st.sampled_from(["layer", "family"]))
    entry = tails[overlap][family][level]
    if kind == "field":
        entry[draw(st.sampled_from(sorted(entry)))] = draw(JUNK)
    elif kind == "drop-field":
        entry.pop(draw(st.sampled_from(sorted(entry))))
    elif kind == "overlap-key":
        tails[draw(st.sampled_from(["0", "-3", "2", "x", "01", " 7"]))] = tails.pop(overlap)
    elif kind == "family":
        tails[overlap][draw(st.sampled_from(["attn", "router_weight", "attn_delta2 "]))] = tails[overlap][family]
    elif kind == "drop-family":
        for fams in tails.values():
            fams.pop(family)
    elif kind == "whole":
        return draw(st.sampled_from([[], [1, 2, 3], {}, {"tails": {}}, {"tails": []}, 3, "x", None]))
    elif kind == "scale-theta":  # a valid table of another healthy run
        entry["theta"] = entry["theta"] * draw(st.floats(0.05, 20))
    return table


def mostly(draw, good, bad):
    """A good value eleven times in twelve: most examples then get past the first refusal, so the
    accepted ones (which run a session) and the later checks (calibration, combinations) are
    reached too."""
    return draw(bad) if draw(st.integers(0, 11)) == 0 else draw(good)


@st.composite
def command_lines(draw, workdir: Path) -> list[str]:
    # Kept small: an accepted example runs delta + 2 intervals of steps (the warnings of long
    # schedules are tests/session/test_startup.py's).
    interval = mostly(draw, st.one_of(st.integers(1, 20), st.just(50)), st.integers(-2, 0))
    delta = mostly(draw, st.one_of(st.integers(1, 40), st.just(100)), st.integers(-1, 0))
    alpha = mostly(draw, st.floats(0.05, 4.0), NUMBERS)
    rate = mostly(draw, st.floats(1e-4, 1e3), NUMBERS)
    argv = ["--mechmon", f"--mechmon-interval={interval}", f"--mechmon-delta={delta}", f"--mechmon-alpha={alpha!r}",
            f"--mechmon-false-alarm-rate={rate!r}",
            "--mechmon-action", mostly(draw, st.sampled_from(["log", "warn", "checkpoint-and-abort"]),
                                       st.just("explode")),
            "--mechmon-monitors", mostly(draw, st.sampled_from(["attn", "router", "attn,router"]),
                                         st.just("attn,bogus")),
            "--train-iters", str(draw(st.integers(1, 500))), "--num-layers", str(draw(st.integers(1, 2)))]
    if draw(st.booleans()):
        argv.append("--mechmon-no-full-matrix-dw")
    if draw(st.booleans()):
        argv.append(f"--mechmon-drill-at={mostly(draw, st.integers(1, 600), st.integers(-1, 0))}")
    for flag, bad in (("--save", ["file", "/proc/ckpt"]), ("--mechmon-log-dir", ["file", "/proc/x"])):
        where = mostly(draw, st.sampled_from(["writable", "writable", None]), st.sampled_from(bad))
        if where is not None:
            argv += [flag, str(workdir / where) if where in ("writable", "file") else where]
    if draw(st.booleans()):
        path = workdir / "tails.json"
        path.write_text(json.dumps(draw(tail_tables())))  # NaN / Infinity as Python's json writes them
        argv += ["--mechmon-detector-calibration", str(path)]
    return argv


class Recorder:
    """Keeps what the session writes (a writer of the session's ``ScalarWriter`` interface, in memory)."""

    def __init__(self) -> None:
        self.rows: dict[int, dict[str, float]] = {}

    def write_scalars(self, scalars: dict, step: int) -> None:
        self.rows.setdefault(int(step), {}).update(scalars)

    def flush(self) -> None:
        pass

    def close(self) -> None:
        pass


def toy_site(layer: int, gen: torch.Generator) -> tuple[AttentionSite, list[torch.Tensor]]:
    weights = [0.02 * torch.randn(HEADS, HEAD_DIM, HIDDEN, generator=gen) for _ in range(2)]
    site = AttentionSite(layer, read_heads=lambda: QKWeights(weights[0], weights[1], 0),
                         read_full=lambda: FullQK(weights[0].reshape(-1, HIDDEN), weights[1].reshape(-1, HIDDEN)))
    return site, weights


def run_a_few_checks(config: MechmonConfig, layers: int) -> dict[int, dict[str, float]]:
    """Three checks with a snapshot behind them (the first check after ``delta``)."""
    gen = torch.Generator().manual_seed(0)
    sites = [toy_site(layer, gen) for layer in range(1, layers + 1)]
    recorder = Recorder()
    session = MonitoringSession(config, [s for s, _ in sites], writer=WriterGroup([recorder]))
    first = config.interval * math.ceil(config.delta / config.interval)
    session.on_train_start(0)
    for it in range(1, first + 2 * config.interval + 1):
        session.on_step_start(it)
        for _, weights in sites:
            for w in weights:
                w += 1e-3 * torch.randn(w.shape, generator=gen)
        session.on_step_end(it)
    session.close()
    return recorder.rows


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("startup_property")
    (root / "writable").mkdir()
    (root / "file").write_text("not a folder")
    return root


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                 HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_every_configuration_is_refused_naming_a_flag_or_runs_its_checks(workdir, data):
    from gpt_trainer.args import build_parser
    from mechmon_megatron.cli.args import add_mechmon_args

    parser = build_parser([add_mechmon_args])
    argv = data.draw(command_lines(workdir))
    stderr = io.StringIO()
    with contextlib.redirect_stderr(stderr):
        try:
            args = parser.parse_args(argv)
        except SystemExit as exc:  # argparse's own type errors (e.g. an int flag given "-1.5"): also exit 2
            assert exc.code == 2
            event("refused by argparse")
            return
        try:
            config = validate_mechmon_args(parser, args)
        except SystemExit as exc:
            assert exc.code == 2
            lines = [line for line in stderr.getvalue().splitlines() if "error:" in line]
            assert len(lines) == 1 and ERROR.match(lines[0]), stderr.getvalue()
            event(f"refused: {lines[0].split('error: ')[1].split()[0]}")
            return
    event("accepted: ran its checks")
    rows = run_a_few_checks(config, args.num_layers)
    checks = sorted(step for step in rows if step % config.interval == 0)
    assert len(checks) >= 3, (argv, sorted(rows))
    assert all(rows[step][names.ACTIVE] == 1.0 for step in checks), (argv, rows)


@settings(max_examples=200, deadline=None)
@given(alpha=NUMBERS, rate=NUMBERS)
def test_the_scan_and_the_trainer_accept_and_refuse_the_same_values(tmp_path_factory, alpha, rate):
    from mechmon_megatron.detect.config_error import ConfigError
    from mechmon_megatron.scan import ScanConfig, ScanInputError

    out = str(tmp_path_factory.getbasetemp() / "scan_out")
    try:
        MechmonConfig(enabled=True, alpha=alpha, false_alarm_rate=rate)
        trainer = None
    except ConfigError as exc:
        trainer = exc
    try:
        ScanConfig(inputs=("run",), out=out, alpha=alpha, false_alarm_rate=rate)
        scan = None
    except ScanInputError as exc:
        scan = str(exc)
    assert (trainer is None) == (scan is None), (trainer, scan)
    if trainer is not None:  # the same reason, the setting in the scan's own flag
        assert scan == f"--{trainer.field.replace('_', '-')} {trainer.reason}"
