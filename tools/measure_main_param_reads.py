"""How much does the increment spectrum change when dW is read from BF16 model weights instead of
the optimizer's FP32 main parameters?

Runs the example trainer in this process with ``--bf16`` (BF16 model parameters, FP32 main
parameters in megatron-core's Float16 optimizer) and a decaying LR schedule. At each check step
``t`` (snapshot at ``t - delta``) a callback holds both reads of every layer's Q/K weights and
computes, from each read, the per-head dW and Delta2 spectral entropies
(``session.attention_check.check_heads``) and the full-matrix dW spectrum and entropy
(``check_full(..., method="exact")``). It prints one JSON object: per check step the LR,
``||dW||_F`` from each read, the relative difference of the singular spectra, the entropy
differences, and the BF16 rounding noise energy ``||dW_model - dW_main||_F^2 / ||dW_main||_F^2``
(with the model of it: BF16 rounding of each read, RMS ~ ``2^-9 |W|`` per element).

    python tools/measure_main_param_reads.py --train-iters 300 --checks 20,60,240,290 --delta 10
    python tools/measure_main_param_reads.py --bytes 8192,64,8,128,8,256,20   # read traffic, no training

On a CPU-only machine the megatron-core mixed-precision optimizers need one more CPU shim than
``mechmon_megatron.testing.cpu_megatron`` has (:func:`allow_cpu_mixed_precision_optimizers`).
The trainer (``gpt_trainer``) and the shims come from the checkout's editable installs
(``make venv``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any, Optional

import torch

MODEL = ["--num-layers", "4", "--hidden-size", "128", "--num-attention-heads", "4", "--seq-length", "128",
         "--micro-batch-size", "4", "--use-cpu-initialization", "--corpus-max-bytes", "2000000"]


def allow_cpu_mixed_precision_optimizers() -> bool:
    """CPU: megatron-core's Float16 and distributed optimizers need the ``optimizer-type-check``
    patch of ``mechmon_megatron.testing.cpu_megatron`` (their constructors compare
    ``Tensor.type()`` with CUDA type names). No-op with CUDA; idempotent."""
    if torch.cuda.is_available():
        return False
    from mechmon_megatron.testing import cpu_megatron

    cpu_megatron.enable_cpu_compat()
    return True


def _qk_reads(reader, np_: int, ng: int, hn: int):
    """(heads, full) of one layer from one read: per-head QKWeights and whole-layer FullQK."""
    from mechmon_megatron.session.host import FullQK, QKWeights
    from mechmon_megatron.session.qkv_layout import split_qk

    wq, wk = split_qk(reader().double(), np_, ng, hn, False)
    heads = QKWeights(wq=wq.clone(), wk=wk.clone(), head_offset=0)
    full = FullQK(wq=wq.reshape(np_ * hn, -1).clone(), wk=wk.reshape(ng * hn, -1).clone())
    return heads, full


METRICS = ("delta2_entropy", "dwq_head_entropy", "dwk_head_entropy", "dw_entropy", "dwk_entropy", "dw_stable_rank")
"""Layer scalars compared (``mechmon/attn/<metric>/layer_L``; per-head ones are head means)."""


def _scalars(*outputs) -> dict[str, float]:
    """``metric -> value`` of check outputs (a ``mean`` partial is a sum over ``count``)."""
    values = {}
    for output in outputs:
        for name, part in output.scalars.items():
            values[name.split("/")[2]] = part.value / part.count if part.reduction == "mean" else part.value
    return values


class ReadComparison:
    """Trainer callback: snapshots both reads at ``t - delta`` and compares them at ``t``."""

    name = "main_param_reads"

    def __init__(self, checks: list[int], delta: int, alpha: float) -> None:
        self.checks, self.delta, self.alpha = sorted(checks), delta, alpha
        self.snap_steps = {t - delta: t for t in self.checks}
        self.layers: list[dict[str, Any]] = []
        self.snapshots: dict[int, list] = {}
        self.rows: list[dict[str, Any]] = []

    def on_train_start(self, ctx) -> None:
        from mechmon_megatron.adapters.megatron_core.discovery import find_modules
        from mechmon_megatron.adapters.megatron_core.main_params import weight_reader
        from mechmon_megatron.session.collective_guard import guard

        found, _ = find_modules(ctx.model_chunks)
        for item in found:
            module, cfg = item.module, item.module.config
            weight = module.linear_qkv.weight
            main, source = weight_reader(weight, ctx.optimizer, layer=item.name, guard=guard())
            model, _ = weight_reader(weight, ctx.optimizer, layer=item.name, setting="model", guard=guard())
            assert source == "main", f"{item.name}: expected FP32 main params with --bf16, got {source}"
            self.layers.append(dict(layer=item.layer_number, weight=weight, reads={"main": main, "model": model},
                                    np=cfg.num_attention_heads, ng=cfg.num_query_groups or cfg.num_attention_heads,
                                    hn=module.hidden_size_per_attention_head))
        guard().create_declared()  # mechmon's own copies of the groups the readers gather over
        if 0 in self.snap_steps:
            self._snapshot(0)

    def _read_all(self) -> list[dict[str, tuple]]:
        return [{k: _qk_reads(r, layer["np"], layer["ng"], layer["hn"])
                 for k, r in layer["reads"].items()} for layer in self.layers]

    def _snapshot(self, iteration: int) -> None:
        self.snapshots[iteration + self.delta] = self._read_all()

    def on_step_end(self, iteration: int, ctx) -> None:
        if iteration in self.snapshots:
            self._compare(iteration, ctx.optimizer.param_groups[0]["lr"], self.snapshots.pop(iteration))
        if iteration in self.snap_steps:
            self._snapshot(iteration)

    def _compare(self, iteration: int, lr: float, before: list) -> None:
        from mechmon_megatron.session.attention_check import check_full, check_heads

        now = self._read_all()
        layers = []
        for layer, prev, cur in zip(self.layers, before, now):
            n = layer["layer"]
            out: dict[str, Any] = {"layer": n}
            dw = {k: cur[k][1].wq - prev[k][1].wq for k in ("main", "model")}
            sv = {k: torch.linalg.svdvals(dw[k]) for k in dw}
            w_abs = cur["main"][1].wq.abs()
            out["dwq_fro_main"] = float(dw["main"].norm())
            out["dwq_fro_model"] = float(dw["model"].norm())
            noise = float((dw["model"] - dw["main"]).norm() ** 2)
            out["rounding_noise_energy_rel"] = noise / max(out["dwq_fro_main"] ** 2, 1e-300)
            # Model: each read rounds w to BF16 (8 significant bits), an error uniform within one
            # ulp = 2^(floor(log2|w|) - 7): variance ulp^2 / 12 (RMS ~ 2^-9 |w|) per read, two
            # independent reads per increment.
            ulp = torch.exp2(torch.floor(torch.log2(w_abs.clamp_min(1e-30))) - 7)
            modelled = float(2 * ulp.pow(2).sum() / 12)
            out["rounding_noise_model_rel"] = modelled / max(out["dwq_fro_main"] ** 2, 1e-300)
            out["sv_rel_diff"] = float((sv["model"] - sv["main"]).norm() / sv["main"].norm())
            out["sv_top_rel_diff"] = float(abs(sv["model"][0] - sv["main"][0]) / sv["main"][0])
            for k in ("main", "model"):
                heads = check_heads(n, prev[k][0], cur[k][0], self.alpha, "gram", False)
                full = check_full(n, prev[k][1], cur[k][1], self.alpha, method="exact")
                for metric, value in _scalars(heads, full).items():
                    if metric in METRICS:
                        out[f"{metric}_{k}"] = value
            for metric in METRICS:
                if f"{metric}_main" in out:
                    out[f"{metric}_diff"] = out[f"{metric}_model"] - out[f"{metric}_main"]
            layers.append(out)
        row = {"iteration": iteration, "window": [iteration - self.delta, iteration], "lr": lr, "layers": layers}
        for key in ("rounding_noise_energy_rel", "sv_rel_diff", "dw_entropy_diff", "delta2_entropy_diff"):
            values = [lay[key] for lay in layers if key in lay]
            if values:
                row[f"mean_{key}"] = sum(values) / len(values)
        self.rows.append(row)
        print(json.dumps({"check": iteration, "lr": lr, **{k: v for k, v in row.items() if k.startswith("mean_")}}),
              file=sys.stderr, flush=True)


def summary(rows: list[dict[str, Any]]) -> list[dict[str, float]]:
    """Per check step: the LR and the layer means of the compared quantities."""
    out = []
    for row in rows:
        layers = row["layers"]
        entry: dict[str, float] = {"iteration": row["iteration"], "lr": row["lr"]}
        for key in ("dwq_fro_main", "dwq_fro_model", "rounding_noise_energy_rel", "rounding_noise_model_rel",
                    "sv_rel_diff", *(f"{m}_{k}" for m in METRICS for k in ("main", "model", "diff"))):
            values = [lay[key] for lay in layers if key in lay]
            if values:
                entry[key] = sum(values) / len(values)
        out.append(entry)
    return out


def markdown_table(entries: list[dict[str, float]], delta: int) -> str:
    """The docs table (layer means): one line per check step."""
    lines = ["| delta | t | LR | ‖dW_q‖_F main / model | noise energy / ‖dW‖² (measured, model) | "
             "spectrum rel. diff | dW_q entropy main → model | per-head dW_q entropy | Delta2 entropy |",
             "|---:|---:|---:|---|---|---:|---|---|---|"]
    for e in entries:
        lines.append(
            f"| {delta} | {int(e['iteration'])} | {e['lr']:.2e} | {e['dwq_fro_main']:.4f} / {e['dwq_fro_model']:.4f} | "
            f"{e['rounding_noise_energy_rel']:.2e}, {e['rounding_noise_model_rel']:.2e} | {e['sv_rel_diff']:.4f} | "
            f"{e['dw_entropy_main']:.3f} → {e['dw_entropy_model']:.3f} | "
            f"{e['dwq_head_entropy_main']:.3f} → {e['dwq_head_entropy_model']:.3f} | "
            f"{e['delta2_entropy_main']:.3f} → {e['delta2_entropy_model']:.3f} |")
    return "\n".join(lines)


def _versions() -> dict[str, str]:
    import megatron.core

    return {"python": platform.python_version(), "torch": torch.__version__,
            "megatron_core": getattr(megatron.core, "__version__", "?"),
            "cpu": platform.processor() or platform.machine(), "threads": str(torch.get_num_threads())}


def read_bytes(hidden: int, heads: int, groups: int, head_dim: int, tp: int, dp: int, layers_per_stage: int,
               users_per_layer: int = 1) -> dict[str, float]:
    """Bytes one check's FP32 main-parameter reads move per rank (distributed optimizer, DP ``dp``).

    ``allreduce``: the former read, every DP rank all-reduces its stage's whole ``linear_qkv``
    TP shard (a ring moves ``2 (dp - 1) / dp`` of it each way, every layer, every rank).
    ``gather``: each rank sends its part of the Q and K rows (``1/dp`` of them) to each of the
    ``users_per_layer`` replicas using the layer (1: per-head work only; 2 with full-matrix dW on
    another replica); a using rank receives ``(dp - 1) / dp`` of the layer's Q/K rows. Bytes per
    rank: the ``sent`` of every rank, the ``received`` of a rank that uses one layer (most ranks
    of a large job use none: ``layers_per_stage * users_per_layer / dp`` layers on average).
    """
    rows_qkv = (heads + 2 * groups) // tp * head_dim
    rows_qk = (heads + groups) // tp * head_dim
    qkv, qk = 4 * rows_qkv * hidden, 4 * rows_qk * hidden
    ring = 2 * (dp - 1) / dp * qkv
    return {
        "allreduce_sent": ring * layers_per_stage, "allreduce_received": ring * layers_per_stage,
        "gather_sent": qk / dp * users_per_layer * layers_per_stage,
        "gather_received_per_used_layer": qk * (dp - 1) / dp,
    }


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--train-iters", type=int, default=300)
    parser.add_argument("--checks", default="20,60,240,290", help="Check iterations (snapshot at t - delta).")
    parser.add_argument("--delta", type=int, default=10)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--min-lr", type=float, default=1e-4, help="Cosine floor (default 0.1 x --lr).")
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--alpha", type=float, default=2.0)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--json", default=None, help="Also write the result to this file.")
    parser.add_argument("--markdown", action="store_true", help="Print the docs table to stderr at the end.")
    parser.add_argument("--bytes", metavar="HIDDEN,HEADS,GROUPS,HEAD_DIM,TP,DP,LAYERS",
                        help="Print, without training, the bytes per rank of one check's main-parameter reads "
                             "(all-reduce before, gather now; read_bytes), e.g. 8192,64,8,128,8,256,20 "
                             "(Llama-3-70B, TP 8, DP 256, 20 layers per pipeline stage).")
    parser.add_argument("trainer_args", nargs="*", help="Extra trainer flags (after --).")
    args = parser.parse_args(argv)
    if args.bytes:
        try:
            hidden, heads, groups, head_dim, tp, dp, layers = (int(v) for v in args.bytes.split(","))
        except ValueError:
            parser.error(f"--bytes takes 7 integers HIDDEN,HEADS,GROUPS,HEAD_DIM,TP,DP,LAYERS, got {args.bytes!r}")
        out = {f"users_{u}": read_bytes(hidden, heads, groups, head_dim, tp, dp, layers, u) for u in (1, 2)}
        print(json.dumps(out, indent=1))
        return 0
    checks = [int(x) for x in args.checks.split(",") if x.strip()]
    if min(checks) - args.delta < 0 or max(checks) > args.train_iters:
        parser.error("every check t needs 0 <= t - --delta and t <= --train-iters")

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from mechmon_megatron.testing.cpu_megatron import enable_cpu_compat

    enable_cpu_compat()
    allow_cpu_mixed_precision_optimizers()
    from gpt_trainer.main import main as train

    trainer_argv = [*MODEL, "--bf16", "--train-iters", str(args.train_iters), "--lr", str(args.lr),
                    "--min-lr", str(args.min_lr), "--lr-warmup-iters", str(args.warmup),
                    "--lr-decay-style", "cosine", "--seed", str(args.seed), "--log-interval", "50",
                    *args.trainer_args]
    comparison = ReadComparison(checks, args.delta, args.alpha)
    start = time.perf_counter()
    rc = train(trainer_argv, callbacks_factory=lambda _: [comparison])
    result = {"command": "python tools/measure_main_param_reads.py " + " ".join(argv or sys.argv[1:]),
              "trainer_argv": trainer_argv, "versions": _versions(), "wall_s": round(time.perf_counter() - start, 1),
              "summary": summary(comparison.rows), "checks": comparison.rows}
    text = json.dumps(result, indent=1)
    print(text)
    if args.json:
        Path(args.json).write_text(text + "\n", encoding="utf-8")
    if args.markdown:
        print(markdown_table(result["summary"], args.delta), file=sys.stderr)
    return rc


if __name__ == "__main__":
    sys.exit(main())
