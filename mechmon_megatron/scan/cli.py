"""``mechmon-scan RUN_DIR_OR_CHECKPOINTS... --out DIR``: flags -> :class:`ScanConfig` -> scan.

Exit codes: 0 the scan finished (with or without an anomaly; read ``summary.json``), 2 bad input
or flags (the message names the file or flag; nothing is written), 130 interrupted (a rerun
with the same arguments continues from the cached pairs).
"""

from __future__ import annotations

import argparse
import logging
import sys
from typing import Optional, Sequence

from mechmon_megatron.scan.config import SHARED_SETTINGS, ScanConfig, scan_flag
from mechmon_megatron.scan.errors import ScanInputError
from mechmon_megatron.session.config import argparse_kwargs
from mechmon_megatron.session.schedule_flags import add_schedule_flags, schedule_from_args

__all__ = ["build_parser", "main"]


def _layers(text: str) -> tuple[int, ...]:
    """``"1,3,5-8"`` -> (1, 3, 5, 6, 7, 8)."""
    out: list[int] = []
    try:
        for part in (p.strip() for p in text.split(",") if p.strip()):
            lo, _, hi = part.partition("-")
            out += list(range(int(lo), int(hi) + 1)) if hi else [int(lo)]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected layer numbers like 1,3,5-8, got {text!r}") from None
    return tuple(out)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="mechmon-scan",
        description="Post-mortem: run the mechmon monitors and detector over a series of saved checkpoints "
                    "(Megatron torch_dist / legacy torch, DeepSpeed, Hugging Face safetensors). docs/SCAN.md.",
        allow_abbrev=False,
    )
    p.add_argument("inputs", nargs="+", metavar="RUN_DIR_OR_CHECKPOINTS",
                   help="a run directory (checkpoints inside) or checkpoint directories")
    p.add_argument("--out", required=True, help="output directory (TensorBoard, summary.json, report.html, cache)")
    p.add_argument("--layers", type=_layers, default=None, help="global 1-based layers, e.g. 1,3,5-8 (default: all)")
    p.add_argument("--every", type=int, default=1, help="judge every k-th checkpoint (default 1)")
    p.add_argument("--window", type=int, default=1,
                   help="compare checkpoint t with t - k, in checkpoints (default 1: consecutive pairs)")
    for name in SHARED_SETTINGS:  # the session's own settings: its help, default and type (checked by ScanConfig)
        p.add_argument(scan_flag(name), **argparse_kwargs(name))
    p.add_argument("--num-attention-heads", type=int, default=None,
                   help="query heads per layer, when the checkpoint does not record it")
    p.add_argument("--num-query-groups", type=int, default=None, help="key/value groups (GQA); default: MHA")
    p.add_argument("--kv-channels", type=int, default=None, help="head dimension; default: Q rows / heads")
    mla = p.add_argument_group("multi-head latent attention and QK-norm (when the checkpoint does not record them)")
    mla.add_argument("--qk-head-dim", type=int, default=None,
                     help="MLA no-RoPE query/key head dim (qk_nope_head_dim); default: from the shapes")
    mla.add_argument("--qk-pos-emb-head-dim", type=int, default=None,
                     help="MLA RoPE query/key head dim (qk_rope_head_dim); default: from the shapes")
    mla.add_argument("--v-head-dim", type=int, default=None, help="MLA value head dim; default: from the shapes")
    mla.add_argument("--normalization", choices=["LayerNorm", "RMSNorm"], default=None,
                     help="kind of the QK-norms / MLA latent norms; default: from the checkpoint, else RMSNorm")
    mla.add_argument("--apply-layernorm-1p", action="store_true",
                     help="the norm weights store gamma - 1 (zero-centred gamma); default: from the checkpoint")
    add_schedule_flags(p, "the run's")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


def config_from_args(args: argparse.Namespace) -> ScanConfig:
    return ScanConfig(
        inputs=tuple(args.inputs), out=args.out, layers=args.layers, every=args.every, window=args.window,
        false_alarm_rate=args.false_alarm_rate, detector_calibration=args.detector_calibration, alpha=args.alpha,
        qk_method=args.qk_method, num_attention_heads=args.num_attention_heads,
        num_query_groups=args.num_query_groups, kv_channels=args.kv_channels, qk_head_dim=args.qk_head_dim,
        qk_pos_emb_head_dim=args.qk_pos_emb_head_dim, v_head_dim=args.v_head_dim, normalization=args.normalization,
        apply_layernorm_1p=args.apply_layernorm_1p, progress=not args.no_progress,
        lr_schedule=schedule_from_args(args, ScanInputError),
    )


def main(argv: Optional[Sequence[str]] = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="mechmon-scan: %(levelname)s: %(message)s")
    args = build_parser().parse_args(argv)
    from mechmon_megatron.scan.runner import run_scan

    try:
        summary = run_scan(config_from_args(args))
    except ScanInputError as exc:
        print(f"mechmon-scan: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("mechmon-scan: interrupted; rerun the same command to continue from the cached pairs",
              file=sys.stderr)
        return 130
    left_out = summary.get("skipped_checkpoints", [])
    if left_out:  # also a warning line each, at the start; repeated here so the end of a log says it
        print(f"mechmon-scan: {len(left_out)} checkpoint folder(s) left out of the series (unreadable): "
              f"{', '.join(s['path'] for s in left_out)}; see summary.json 'skipped_checkpoints'", file=sys.stderr)
    print(f"mechmon-scan: {summary['sentence']} ({summary['pairs']} pairs; report: {args.out}/report.html)")
    return 0
