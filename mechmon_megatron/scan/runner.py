"""The scan, start to end: find the series, check it, compute each layer's pairs, replay, write.

Memory: layers are scanned one at a time, and for each layer the checkpoints in iteration
order, keeping only the ``window + 1`` most recent copies of that one layer (two with the
default window of 1). Readers keep metadata only (DCP metadata, safetensors headers, memory
maps of ``torch.save`` files); tensor data is read per layer.
"""

from __future__ import annotations

import json
import logging
import os
import platform
import shutil
import time
from collections import defaultdict
from typing import Any, Optional

import torch

from mechmon_megatron.detect.config_error import ConfigError
from mechmon_megatron.detect.phase_moments import attention_kind_of
from mechmon_megatron.scan.cache import PairCache, fingerprint
from mechmon_megatron.scan.config import ScanConfig, scan_error
from mechmon_megatron.scan.errors import ScanInputError
from mechmon_megatron.scan.outputs import manifest
from mechmon_megatron.scan.outputs.report import write_report
from mechmon_megatron.scan.outputs.staging import Staging
from mechmon_megatron.scan.outputs.tensorboard import write_jsonl, write_tensorboard
from mechmon_megatron.scan.pairs import PairRecord, compute_pair
from mechmon_megatron.scan.readers import CheckpointReader, HeadHints, LayerWeights, open_reader
from mechmon_megatron.scan.replay import ReplayResult, replay, scan_families, session_config
from mechmon_megatron.scan.schedule import ScanPlan, make_plan
from mechmon_megatron.scan.series import discover
from mechmon_megatron.session.startup import check_detector

logger = logging.getLogger(__name__)

__all__ = ["SUMMARY_VERSION", "run_scan"]

SUMMARY_VERSION = 1
CACHE_DIR = "cache"
SCALARS_FILE = "mechmon_scalars.jsonl"


def _open_all(config: ScanConfig) -> tuple[ScanPlan, list[CheckpointReader], list[int], list[int]]:
    """Open every checkpoint (metadata only) and check the series before anything is computed."""
    refs, skipped = discover(config.inputs, config.window)
    plan = make_plan(refs, config.every, config.window, tuple(skipped))
    if not plan.pairs:
        raise ScanInputError(f"--every {config.every} / --window {config.window} leave no pair among "
                             f"{len(refs)} checkpoints.")
    hints = HeadHints(num_heads=config.num_attention_heads, num_groups=config.num_query_groups,
                      head_dim=config.kv_channels, qk_head_dim=config.qk_head_dim,
                      qk_pos_emb_head_dim=config.qk_pos_emb_head_dim, v_head_dim=config.v_head_dim,
                      normalization=config.normalization,
                      zero_centered_gamma=True if config.apply_layernorm_1p else None, source="flags")
    readers = [open_reader(r.format, r.path, r.iteration, hints) for r in refs]
    first = readers[0]
    shapes = first.shapes()
    available = sorted(shapes)
    layers = list(config.layers) if config.layers is not None else available
    unknown = [L for L in layers if L not in shapes]
    if unknown:
        raise ScanInputError(f"--layers {unknown} not in the checkpoints; their layers with Q/K weights are "
                             f"{available} (global, 1-based).")
    for reader in readers[1:]:
        other = reader.shapes()
        for layer in layers:
            if layer not in other:
                raise ScanInputError(f"{reader.path}: has no Q/K weights for layer {layer}, which {first.path} has; "
                                     "all checkpoints of a scan must be of one model.")
            if other[layer] != shapes[layer]:
                raise ScanInputError(
                    f"{reader.path}: layer {layer} tensors have shapes {other[layer].qk} (router "
                    f"{other[layer].router}), expected {shapes[layer].qk} (router {shapes[layer].router}) as in "
                    f"{first.path}; the model changed between checkpoints."
                )
    for layer in layers:
        first.heads(layer)  # head counts resolve (or the flag to pass is named) before any work
    routers = [L for L in layers if shapes[L].router is not None]
    return plan, readers, layers, routers


def _key(config: ScanConfig, series: list[list[Any]], readers: list[CheckpointReader], layer: int) -> str:
    """What a layer's cached values depend on; ``series``: [iteration, path, newest mtime] per checkpoint."""
    counts = readers[0].heads(layer)
    heads: Any = [counts.num_heads, counts.num_groups, counts.head_dim]
    if counts.mla is not None or counts.norm is not None:  # the keys of classic layers without norms stay as they were
        heads = counts.to_json()
    return fingerprint({
        "checkpoints": series, "heads": heads, "alpha": config.alpha, "qk_method": config.qk_method, "layer": layer,
    })


def _mtime(path: str) -> float:
    newest = os.path.getmtime(path)
    for root, _, files in os.walk(path):
        for name in files:
            newest = max(newest, os.path.getmtime(os.path.join(root, name)))
    return newest


class _Progress:
    """tqdm over (checkpoints x layers) on stderr, only on a terminal (never in logs)."""

    def __init__(self, total: int, enabled: bool) -> None:
        self._bar: Optional[Any] = None
        if enabled:
            try:
                from tqdm import tqdm

                self._bar = tqdm(total=total, unit="ckpt-layer", desc="mechmon-scan", disable=None)
            except ImportError:
                logger.info("tqdm not installed: no progress bar")

    def update(self, n: int = 1) -> None:
        if self._bar is not None:
            self._bar.update(n)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


def _scan_layer(config: ScanConfig, plan: ScanPlan, readers: list[CheckpointReader], layer: int,
                cache: PairCache, progress: _Progress, timing: dict[str, float]) -> list[PairRecord]:
    needed = sorted({i for pair in plan.pairs for i in pair})
    todo = {pair for pair in plan.pairs if cache.get(*plan.iterations(pair)) is None}
    last_use = {i: max((p[1] for p in todo if i in p), default=-1) for i in needed}
    held: dict[int, LayerWeights] = {}
    for index in needed:
        if last_use[index] >= 0:
            start = time.perf_counter()
            held[index] = readers[index].read_layer(layer)
            timing["read_s"] += time.perf_counter() - start
            for pair in sorted(p for p in todo if p[1] == index):
                earlier, later = plan.iterations(pair)
                start = time.perf_counter()
                record = compute_pair(held[pair[0]], held[index], earlier, later, config.alpha, config.qk_method)
                timing["compute_s"] += time.perf_counter() - start
                timing["pairs_computed"] += 1
                cache.add(record)
            for old in [i for i in held if last_use[i] <= index]:
                del held[old]  # at most window + 1 copies of this layer are alive
        progress.update()
    out = []
    for pair in plan.pairs:
        done = cache.get(*plan.iterations(pair))
        assert done is not None  # every pair was computed above or cached before
        out.append(done)
    return out


def _summary(config: ScanConfig, plan: ScanPlan, readers: list[CheckpointReader], layers: list[int],
             routers: list[int], result: ReplayResult, timing: dict[str, float]) -> dict[str, Any]:
    first = result.first_anomaly
    sentence = first.sentence() if first else "no anomaly"
    computed = int(timing["pairs_computed"])
    pairs_done = computed / max(1, len(layers))
    per_pair = (timing["read_s"] + timing["compute_s"]) / pairs_done if computed else None
    return {
        "version": SUMMARY_VERSION,
        "first_anomaly": None if first is None else {
            "after_iteration": first.after_iteration, "before_iteration": first.before_iteration,
            "family": first.family, "layer": first.layer, "heads": first.heads, "level": first.level,
            "layers": first.layers, "reason": first.reason,
        },
        "pairs": len(plan.pairs),
        "sentence": sentence,
        "anomalies": [a.to_json() for a in result.anomalies],
        "format": readers[0].format,
        "checkpoints": [r.iteration for r in readers],
        "checkpoint_paths": [r.path for r in readers],
        "skipped_checkpoints": [skip.to_json() for skip in plan.skipped],
        "layers": layers,
        "router_layers": routers,
        "heads": {str(L): _heads_json(readers[0], L) for L in layers},
        "save_interval_steps": plan.save_interval,
        "interval_steps": plan.interval,
        "window_steps": plan.delta,
        "every": config.every,
        "window": config.window,
        "false_alarm_rate": config.false_alarm_rate,
        "detector": result.thresholds,
        "notes": list(plan.notes) + list(result.thresholds.get("notes", [])) + _warmup_note(plan, result),
        "timing": {
            "pairs_computed_this_run": int(pairs_done),
            "layer_pairs_computed_this_run": computed,
            "read_s": round(timing["read_s"], 4),
            "compute_s": round(timing["compute_s"], 4),
            "seconds_per_pair": None if per_pair is None else round(per_pair, 4),
            "wall_s": round(time.perf_counter() - timing["start"], 3),
            "machine": {"python": platform.python_version(), "torch": torch.__version__,
                        "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads()},
        },
    }


def _warmup_note(plan: ScanPlan, result: ReplayResult) -> list[str]:
    warmup = int(result.thresholds["design"]["warmup_checks"])
    if len(plan.pairs) > warmup:
        return []
    return [f"only {len(plan.pairs)} pairs: the detector's warm-up takes the first {warmup} checks (max(5, "
            f"ceil(200 / {plan.interval} steps))), so this series was not judged; 'no anomaly' means no data"]


def _heads_json(reader: CheckpointReader, layer: int) -> dict[str, Any]:
    """``num_heads``, ``num_groups``, ``head_dim``; with ``mla`` (its dims) and ``norm`` (the
    QK-norm or latent-norm kind) where the layer has them."""
    return reader.heads(layer).to_json()


def _check_detector(config: ScanConfig, plan: ScanPlan, layers: list[int], routers: list[int]) -> None:
    """The online session's start-up check of the detector, for the scan's shape (its checks,
    window and layers): a rate or calibration that cannot give thresholds stops here, before
    anything is computed or written."""
    online = session_config(plan, config.false_alarm_rate, config.detector_calibration)
    shape = {family: len(numbers) for family, numbers in scan_families(layers, routers).items()}
    try:
        check_detector(online, shape)
    except ConfigError as exc:
        raise scan_error(exc) from None


def run_scan(config: ScanConfig) -> dict[str, Any]:
    """Scan the series; returns the summary written to ``OUT/summary.json``.

    Bad input found before the first pair is computed writes nothing; a folder this run created
    is removed again when the scan stops on bad input later (a checkpoint unreadable mid-series).
    """
    timing: dict[str, float] = defaultdict(float)
    timing["start"] = time.perf_counter()
    manifest.check(config.out)  # before anything is read: --out must be ours (or new, or empty)
    plan, readers, layers, routers = _open_all(config)
    _check_detector(config, plan, layers, routers)
    created = manifest.claim(config.out)
    stale = manifest.clean_stale(config.out)
    if stale:
        logger.warning("removed %s left in %s by an interrupted scan", ", ".join(stale), config.out)
    try:
        return _run(config, plan, readers, layers, routers, timing)
    except ScanInputError:
        if created:
            shutil.rmtree(config.out, ignore_errors=True)
        raise


def _run(config: ScanConfig, plan: ScanPlan, readers: list[CheckpointReader], layers: list[int],
         routers: list[int], timing: dict[str, float]) -> dict[str, Any]:
    os.makedirs(os.path.join(config.out, CACHE_DIR), exist_ok=True)
    needed = len({i for pair in plan.pairs for i in pair})
    progress = _Progress(needed * len(layers), config.progress)
    by_check: dict[int, list[PairRecord]] = defaultdict(list)
    series = [[r.iteration, r.path, _mtime(r.path)] for r in readers]
    try:
        for layer in layers:
            cache = PairCache(os.path.join(config.out, CACHE_DIR), layer, _key(config, series, readers, layer))
            try:
                for record in _scan_layer(config, plan, readers, layer, cache, progress, timing):
                    by_check[record.later].append(record)
            finally:
                cache.close()
    finally:
        progress.close()
    attention = attention_kind_of(any(readers[0].heads(L).mla is not None for L in layers))
    result = replay(plan, by_check, layers, routers, config.false_alarm_rate, config.detector_calibration,
                    config.lr_schedule, attention)
    summary = _summary(config, plan, readers, layers, routers, result, timing)
    with Staging(config.out) as stage:
        write_tensorboard(os.path.join(stage.path, "tensorboard"), result.checks)
        write_jsonl(os.path.join(stage.path, SCALARS_FILE), result.checks)
        entries = ["tensorboard", SCALARS_FILE]
        entries += write_report(stage.path, summary, result.checks, layers, routers, result.first_anomaly)
        with open(os.path.join(stage.path, "summary.json"), "w", encoding="utf-8") as f:
            json.dump(summary, f, indent=1, allow_nan=False)  # strict JSON: other tools read it
        # The old summary goes first and the new one comes last: while the other outputs are
        # swapped in, no summary.json vouches for a mix of two scans.
        old = os.path.join(config.out, "summary.json")
        if os.path.exists(old):
            os.remove(old)
        manifest.record(config.out, entries + ["summary.json"])  # listed before they are moved in
        stage.commit(entries + ["summary.json"])
    return summary
