"""Issue 19, round 8: the persistence of Delta2's leading direction as a detector family of its own,
at the SAME false-alarm rate, on the records of the short-window campaign (pre-registered in
docs/RESULTS.md, "Round 8").

The statistic is already recorded per head by every run of that campaign (``--mechmon-short-window``):
``mechmon/attn/delta2_short_persistence/layer_L/head_H`` = |<u_k, u_k-1>| |<v_k, v_k-1>|, the
overlap of the leading singular directions of Delta2 in two adjacent one-interval windows, in
[0, 1] (``monitors/leading_direction.py``). A biased rounding error keeps pushing one direction,
so under the fault it rises; healthy updates rotate.

Design ``long+persist``: today's four families plus one family of per-head persistence streams
(direction: rise), with the sequential design of every family (baseline of the last 50 accepted
checks, fault-side slope, clip, trim over the heads, k = 1, warm-up) and its own tests in the
union bound: one CUSUM per layer and its family CUSUM, ``N + L + 1`` tests.

It is replayed through the round-5 machinery (``short_window_study``), with no new detector code:
each record's short-window entropy streams are replaced by the NEGATED persistence of the same
head under the short family's names. A rise of ``p`` is a drop of ``-p``, and the baseline is
symmetric under that sign change: its scale floors use ``|prediction|`` and its fault-side slope
follows the direction (tested: ``tests/research/study/test_persistence_study.py``). So the
``long+short`` design of those results IS ``long+persist``; :func:`markdown` labels it so.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any, Optional

from mechmon_megatron.detect.null_model import DEFAULT_FALSE_ALARM_RATE
from mechmon_megatron.research.study.campaign_data import CampaignRecord
from mechmon_megatron.research.study.detector_report import CALIBRATION_RUNS
from mechmon_megatron.research.study.short_window_study import SHORT, run_short_window_study
from mechmon_megatron.research.study.short_window_study import markdown as short_markdown
from mechmon_megatron.session import names
from mechmon_megatron.session.detector_inputs import stream_family

PERSISTENCE_STREAM = re.compile(rf"^{names.PREFIX}/attn/delta2_short_persistence/layer_(\d+)/head_(\d+)$")
DESIGN = "long+persist"
FAMILY_LABEL = "attn_persistence"
CHOICE_SEEDS = (1, 2, 3)
HELD_OUT_SEEDS = tuple(range(4, 16))
"""Every seed but the choice seeds 1-3 is held out in round 8 (fault seeds 4-12, healthy 3-15)."""
_LABELS = (("long+short", DESIGN), (SHORT, FAMILY_LABEL), ("Δ2 short", "persistence"))


def persistence_as_short_family(checks: Sequence[tuple[int, Mapping[str, float]]]
                                ) -> list[tuple[int, dict[str, float]]]:
    """The checks with the short-window entropy streams replaced by ``-persistence`` of the same
    head under their names (other scalars kept). A check without persistence (the first after a
    fork or a resume: the previous window's directions are not checkpointed) has no short stream."""
    out = []
    for step, scalars in checks:
        kept = {k: v for k, v in scalars.items() if stream_family(k) != SHORT}
        for key, value in scalars.items():
            match = PERSISTENCE_STREAM.match(key)
            if match:
                kept[names.attn("delta2_entropy_short", int(match[1]), int(match[2]))] = -float(value)
        out.append((step, kept))
    return out


def persistence_records(records: Mapping[str, CampaignRecord]) -> dict[str, CampaignRecord]:
    """Every record with :func:`persistence_as_short_family` applied; ``ValueError`` naming the runs
    that hold no persistence streams (recorded without ``--mechmon-short-window``)."""
    lacking = sorted(r for r, rec in records.items()
                     if not any(PERSISTENCE_STREAM.match(k) for _, sc in rec.data.checks for k in sc))
    if lacking:
        raise ValueError(f"no delta2_short_persistence streams in {', '.join(lacking)} "
                         "(recorded without --mechmon-short-window)")
    return {r: replace(rec, data=replace(rec.data, checks=persistence_as_short_family(rec.data.checks)))
            for r, rec in records.items()}


def run_persistence_study(
    records: Mapping[str, CampaignRecord],
    rate: float = DEFAULT_FALSE_ALARM_RATE,
    logit_threshold: Optional[float] = None,
    calibration: Sequence[str] = CALIBRATION_RUNS,
) -> dict[str, Any]:
    """``short_window_study.run_short_window_study`` on :func:`persistence_records`: per run the
    first alarms of ``long`` and of ``long+persist`` (under the key ``"long+short"``, whose
    ``attn_delta2_short`` entries are the persistence family), the max-logit rule, the leads."""
    results = run_short_window_study(persistence_records(records), rate=rate, logit_threshold=logit_threshold,
                                     calibration=calibration)
    results["design_under_long+short"] = DESIGN
    return results


def markdown(results: Mapping[str, Any], held_out_seeds: Sequence[int] = ()) -> str:
    """The round-5 tables with the second design, its family and its column named for what they hold."""
    text = short_markdown(results, held_out_seeds=held_out_seeds)
    for old, new in _LABELS:
        text = text.replace(old, new)
    return text
