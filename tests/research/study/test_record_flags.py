"""Exported records hold no path of the machine that trained them: a flag naming a file inside the
campaign folder is written relative to it; other flags, and paths outside it, are kept as given.
Every committed record is checked too."""

from __future__ import annotations

import glob
import gzip
import json
import os

from mechmon_megatron.research.study.campaign_records import _portable

ROOT = os.path.join(os.path.dirname(__file__), "..", "..", "..")


def test_a_path_inside_the_campaign_becomes_relative(tmp_path):
    campaign = tmp_path / "runs" / "study"
    assert _portable(str(campaign / "provisional_null_tails.json"), str(campaign)) == "provisional_null_tails.json"
    assert _portable(str(campaign / "a" / "b.json"), str(campaign)) == os.path.join("a", "b.json")
    for kept in ("--lr", "2e-3", "relative/file.json", str(tmp_path / "elsewhere.json"),
                 str(tmp_path / "runs" / "study2" / "x.json")):  # a sibling that shares the prefix
        assert _portable(kept, str(campaign)) == kept


def test_the_committed_records_name_no_machine_path():
    files = glob.glob(os.path.join(ROOT, "docs", "data", "*", "*.json.gz"))
    assert files
    for path in files:
        with gzip.open(path, "rt", encoding="utf-8") as f:
            flags = json.load(f)["run"]["flags"]
        assert not [flag for flag in flags if os.path.isabs(flag)], path
