"""One alarm, one record: :class:`Alert` and ``mechmon_alert.json`` (:class:`AlertReport`) round
trip through JSON, keep every key the file has always had, and older files still load."""

from __future__ import annotations

import json
import math

import pytest

from mechmon_megatron.session.alert import ALERT_FAMILIES, ALERT_FORMAT, Alert, AlertReport

CUSUM = Alert(iteration=120, family="attn_delta2", stream="mechmon/detect/attn_delta2/cusum/layer_3", layer=3,
              head=5, value=9.5, baseline=None, threshold=7.25, first_warning_step=40, reason="shifted",
              level="layer", kind="cusum", layers=(3,), heads=(5, 6))
DRILL = Alert(iteration=120, family="drill", stream="drill", layer=None, head=None, value=0.0, baseline=None,
              threshold=None, first_warning_step=120, reason="rehearsal requested by --mechmon-drill-at")
KEYS = ["iteration", "family", "stream", "layer", "head", "value", "baseline", "threshold", "first_warning_step",
        "reason", "level", "kind", "layers", "heads"]
"""An alert's keys, in the order the session has always written them."""
FILE_KEYS = ["format", "iteration", "family", "layer", "head", "value", "baseline", "threshold",
             "first_warning_step", "layers", "heads", "last_checkpoint_before_first_warning", "checkpoint_dir",
             "action", "exit_code", "alerts"]


def _report(*alerts: Alert) -> AlertReport:
    return AlertReport(iteration=120, alerts=alerts, checkpoint_dir="/ck/iter_0000120",
                       last_checkpoint_before_first_warning={"iteration": 20, "path": "/ck/iter_0000020"},
                       exit_code=42, action="checkpoint-and-abort")


@pytest.mark.parametrize("alert", [CUSUM, DRILL], ids=["cusum", "drill"])
def test_alert_round_trips_through_json(alert: Alert):
    body = json.loads(json.dumps(alert.to_json()))
    assert list(body) == KEYS
    assert Alert.from_json(body) == alert


def test_a_non_finite_value_survives_the_file():
    alert = Alert(iteration=7, family="nonfinite", stream="weights", layer=2, head=None, value=math.nan,
                  baseline=None, threshold=None, first_warning_step=7, reason="layer 2: non-finite", kind="nonfinite",
                  layers=(2,))
    back = Alert.from_json(json.loads(json.dumps(alert.to_json(), allow_nan=True)))
    assert math.isnan(back.value) and back.to_json().keys() == alert.to_json().keys()
    assert {k: v for k, v in back.to_json().items() if k != "value"} == \
        {k: v for k, v in alert.to_json().items() if k != "value"}


def test_alert_is_frozen_and_refuses_unknown_kinds():
    with pytest.raises(AttributeError):
        CUSUM.family = "attn_dw"  # type: ignore[misc]
    with pytest.raises(ValueError, match="kind 'spike' is not one of"):
        Alert.from_json({**CUSUM.to_json(), "kind": "spike"})
    with pytest.raises(ValueError, match="no family"):
        Alert.from_json({**CUSUM.to_json(), "family": ""})
    assert {"nonfinite", "drill", CUSUM.family} <= set(ALERT_FAMILIES)


def test_the_file_keeps_its_keys_and_round_trips(tmp_path):
    report = _report(CUSUM, DRILL)
    path = report.write(str(tmp_path))
    body = json.loads(open(path, encoding="utf-8").read())
    assert list(body) == FILE_KEYS and body["format"] == ALERT_FORMAT
    # The first alert's fields at the top, for readers of one alarm (the supervisor, users).
    assert {k: body[k] for k in ("family", "layer", "head", "first_warning_step", "layers", "heads")} == {
        "family": "attn_delta2", "layer": 3, "head": 5, "first_warning_step": 40, "layers": [3], "heads": [5, 6]}
    assert [a["family"] for a in body["alerts"]] == ["attn_delta2", "drill"]
    assert AlertReport.from_json(body) == report


def test_an_empty_report_and_extra_keys():
    body = AlertReport(iteration=3, alerts=(), checkpoint_dir=None, last_checkpoint_before_first_warning=None,
                       exit_code=None, action="warn", extra={"host": "deepspeed"}).to_json()
    assert body["family"] is None and body["layers"] == [] and body["host"] == "deepspeed"
    back = AlertReport.from_json(body)
    assert back.alerts == () and back.extra == {"host": "deepspeed"} and back.to_json() == body


def test_files_without_a_format_still_load():
    """A file of an earlier release (no ``format``), and one with the top-level keys only (no
    ``alerts``: written by hand, or by a host's own wrapper) load; its one alert is the top level."""
    earlier = _report(CUSUM).to_json()
    del earlier["format"]
    assert AlertReport.from_json(earlier) == _report(CUSUM)
    minimal = {"iteration": 12, "family": "attn_dw", "first_warning_step": 3, "layers": [1], "heads": [0],
               "checkpoint_dir": "/ck/iter_0000012", "action": "checkpoint-and-abort", "exit_code": 42}
    report = AlertReport.from_json(minimal)
    (alert,) = report.alerts
    assert (report.iteration, alert.family, alert.first_warning_step, alert.layers, alert.heads) == (
        12, "attn_dw", 3, (1,), (0,))
    assert math.isnan(alert.value) and alert.kind == "" and report.exit_code == 42


def test_a_newer_format_or_a_malformed_file_is_refused():
    with pytest.raises(ValueError, match="format 2: written by a newer mechmon-megatron"):
        AlertReport.from_json({**_report(CUSUM).to_json(), "format": 2})
    with pytest.raises(TypeError, match="alerts must be a list"):
        AlertReport.from_json({**_report(CUSUM).to_json(), "alerts": "x"})
    with pytest.raises(TypeError):
        AlertReport.from_json([1, 2])  # type: ignore[arg-type]
    with pytest.raises(KeyError):
        AlertReport.from_json({"family": "attn_dw"})
