"""The supervisor reads ``mechmon_alert.json`` with the session's own reader (``AlertReport``)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mechmon_megatron.session.alert import Alert, AlertReport
from mechmon_megatron.supervise.alerts import AlertError, alert_files, read_alert

ALARM = Alert(iteration=120, family="router_entropy", stream="router_entropy/layer_2", layer=2, head=None,
              value=0.4, baseline=None, threshold=0.7, first_warning_step=None, reason="below the floor",
              level="layer", kind="limit", layers=(2,))


def _write(folder: Path, *alerts: Alert) -> str:
    return AlertReport(iteration=120, alerts=alerts, checkpoint_dir=str(folder),
                       last_checkpoint_before_first_warning=None, exit_code=42,
                       action="checkpoint-and-abort").write(str(folder))


def test_the_supervisor_reads_what_the_session_writes(tmp_path: Path):
    save = tmp_path / "ck"
    before = alert_files(str(save))
    path = _write(save / "iter_0000120", ALARM)
    info = read_alert(str(save), before)
    assert (info.path, info.iteration, info.family, info.alert) == (path, 120, "router_entropy", ALARM)
    assert info.change_point == 120  # no first-warning step: the alarm's iteration
    assert info.to_json() == {"family": "router_entropy", "layers": [2], "heads": [], "iteration": 120,
                              "first_warning_step": None, "file": path}


def test_a_file_of_a_newer_format_or_without_an_alert_is_corrupt(tmp_path: Path):
    save = tmp_path / "ck"
    folder = save / "iter_0000120"
    before = alert_files(str(save))
    path = _write(folder)  # no alert in it
    with pytest.raises(AlertError, match="is corrupt .*no alert in it"):
        read_alert(str(save), before)
    body = json.loads(Path(path).read_text())
    Path(path).write_text(json.dumps({**AlertReport.from_json(body).to_json(), "format": 9, "family": "attn_dw"}))
    with pytest.raises(AlertError, match="is corrupt .*format 9"):
        read_alert(str(save), before)
