"""A campaign's records without its checkpoints: small enough to keep in the repository.

``export_records(campaign_dir, dest)`` writes one ``<run_id>.json.gz`` per run (forks already
joined to their parents) with what the detector study's analysis reads: per step the loss, grad
norm and max attention logit; per check the detector's input streams, the routing-entropy floor,
MaxVio, the W_q spectral norm, and the online ``mechmon/alarm`` / ``mechmon/detect/*`` values.
Values are written as JSON floats (exact), so a replay of the records equals a replay of the runs.
``load_records(dest)`` reads them back as :class:`~mechmon_megatron.research.study.campaign_data.CampaignRecord`.
"""

from __future__ import annotations

import dataclasses
import gzip
import json
import math
import os
from typing import Any, Optional

from mechmon_megatron.research.study.analysis import RunData
from mechmon_megatron.research.study.campaign_data import CampaignRecord, load_campaign
from mechmon_megatron.research.study.long_plan import CampaignRun
from mechmon_megatron.session.detector_inputs import stream_family

RECORD_VERSION = 1
_KEPT_PREFIXES = (
    "mechmon/router/token_entropy_floor/",
    "mechmon/router/max_vio/",
    "mechmon/attn/wq_spectral_norm/",
    "mechmon/attn/delta2_short_persistence/",
    "mechmon/attn/delta2_whole_entropy/",  # MLA's whole stream (the frontier study's secondary replay)
    "mechmon/detect/",
    "mechmon/alarm",
)


def _kept(name: str) -> bool:
    return stream_family(name) is not None or name.startswith(_KEPT_PREFIXES)


def _json_float(x: float) -> Any:
    return x if math.isfinite(x) else None


def export_records(campaign_dir: str, dest: str, runs: Optional[list[CampaignRun]] = None) -> list[str]:
    """Write the records of every run under ``campaign_dir`` (of ``runs``, default the study's
    plan); returns the files written."""
    os.makedirs(dest, exist_ok=True)
    paths = []
    for run_id, record in sorted(load_campaign(campaign_dir, runs).items()):
        d = record.data
        run = dataclasses.asdict(record.run)
        run["flags"] = [_portable(flag, campaign_dir) for flag in run["flags"]]
        body = {
            "version": RECORD_VERSION,
            "run": run,
            "status": {k: v for k, v in record.status.items() if k in ("state", "last_iteration", "divergence")},
            "metrics": {
                "iteration": d.steps,
                "lm_loss": [_json_float(x) for x in d.loss],
                "grad_norm": [_json_float(x) for x in d.grad_norm],
                "max_attn_logit": [_json_float(x) for x in d.max_attn_logit],
            },
            "checks": [
                {"step": step, "scalars": {k: _json_float(v) for k, v in sorted(sc.items()) if _kept(k)}}
                for step, sc in d.checks
            ],
        }
        path = os.path.join(dest, f"{run_id}.json.gz")
        with gzip.open(path + ".tmp", "wt", encoding="utf-8", compresslevel=9) as f:
            json.dump(body, f, separators=(",", ":"))
        os.replace(path + ".tmp", path)
        paths.append(path)
    return paths


def _portable(flag: str, campaign_dir: str) -> str:
    """A flag naming a file inside the campaign folder, relative to it (``provisional_null_tails.json``):
    the records hold no path of the machine that trained them."""
    root = os.path.abspath(campaign_dir)
    if os.path.isabs(flag) and os.path.commonpath([root, os.path.abspath(flag)]) == root:
        return os.path.relpath(flag, root)
    return flag


def load_record(path: str) -> CampaignRecord:
    """One exported run (``<run_id>.json.gz``); ValueError names a file of another version."""
    with gzip.open(path, "rt", encoding="utf-8") as f:
        body = json.load(f)
    if body.get("version") != RECORD_VERSION:
        raise ValueError(f"{os.path.basename(path)}: record version {body.get('version')!r}, expected {RECORD_VERSION}")
    run_fields = {k: tuple(v) if isinstance(v, list) else v for k, v in body["run"].items()}
    run = CampaignRun(**run_fields)
    m = body["metrics"]
    metrics = [
        {"iteration": it, "lm_loss": lo, "grad_norm": gn, "max_attn_logit": ml}
        for it, lo, gn, ml in zip(m["iteration"], m["lm_loss"], m["grad_norm"], m["max_attn_logit"])
    ]
    data = RunData.from_rows(metrics, body["checks"])
    return CampaignRecord(run=run, data=data, status=body["status"])


def load_records(dest: str) -> dict[str, CampaignRecord]:
    """The exported runs, by run id (ValueError names a file of another version)."""
    out = {}
    for name in sorted(os.listdir(dest)):
        if name.endswith(".json.gz"):
            record = load_record(os.path.join(dest, name))
            out[record.run.run_id] = record
    return out
