"""Benchmark the MLA Delta2 kernel on one random multi-head latent attention layer.

Usage::

    python tools/bench_mla.py --device cuda --json          # DeepSeek-V3 layer (the defaults)
    python tools/bench_mla.py --hidden 256 --num-heads 8 --q-lora-rank 64 --kv-lora-rank 32 \\
        --d-nope 16 --d-rope 8 --d-v 16 --json             # tiny
    python tools/bench_mla.py --q-lora-rank 0 ...            # no query latent (linear_q_proj)

Synthetic layer (why: it resembles a real increment without needing a checkpoint): every weight
``W ~ N(0, 0.02)``, norm gammas ``1 + N(0, 0.1)``; each ``dW`` has elementwise RMS ``--dw-scale``
(default 1e-3), half of its energy in a coherent rank-4 component and half Gaussian noise (as in
``tools/bench_monitors.py``); gammas move by ``--dw-scale`` noise. Weights stored in ``--dtype``.

Timed per layer (median of ``--repeats`` after a warm-up; CUDA synchronised):

* ``mla_latent``: ``mla_delta2_singular_values`` (both streams).
* ``explicit_baseline``: per head chunk, form ``A_h`` and ``B_h`` (prev and now) explicitly in
  float64 (``[c, d_qk, hidden]``), then the classic compressed method on them (thin QR of
  ``X_h = [dA^T, A^T]`` and ``Y_h = [B^T, dB^T]`` in hidden space, cores ``R_X R_Y^T``, svdvals),
  one QR per side serving both streams (columns ordered no-RoPE first). Timed on
  ``--baseline-heads`` heads (default all) and scaled linearly (``baseline_scaled``).

``max_rel_err``: worst relative difference between the two on the baseline heads, over values
above 1e-6 of their row's largest. ``flops``: analytic counts (multiply-add = 2; Householder QR of
``m x n`` = ``2 m n^2 - 2 n^3 / 3``; svdvals of the small cores not counted, the same in both).
Prints one JSON object with ``--json``, a table otherwise. ``main(argv)`` returns the dict.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable, Sequence

import torch

from mechmon_megatron.monitors.mla_increment import MLAWeights, mla_delta2_singular_values
from mechmon_megatron.monitors.qk_increment import _fit
from mechmon_megatron.plan.report import cpu_name

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # the sibling benchmark, also when loaded by path
import bench_monitors  # noqa: E402

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64}
REL_FLOOR = 1e-6
SLOW_CALL_S = 30.0  # a call slower than this is timed once


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hidden", type=int, default=7168, help="model hidden size")
    p.add_argument("--num-heads", type=int, default=128, help="query heads in the layer (or per TP rank)")
    p.add_argument("--q-lora-rank", type=int, default=1536, help="query latent rank; 0: no latent (q_proj)")
    p.add_argument("--kv-lora-rank", type=int, default=512, help="KV latent rank")
    p.add_argument("--d-nope", type=int, default=128, help="no-RoPE q/k head dim (qk_head_dim)")
    p.add_argument("--d-rope", type=int, default=64, help="RoPE head dim (qk_pos_emb_head_dim)")
    p.add_argument("--d-v", type=int, default=128, help="value head dim (only sizes kv_up)")
    p.add_argument("--head-chunk", type=int, default=16, help="heads processed together (both kernels)")
    p.add_argument("--baseline-heads", type=int, default=None, help="heads the baseline is timed on (default all)")
    p.add_argument("--device", default="cpu", help="torch device, e.g. cpu, cuda, cuda:1")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="float32", help="storage dtype of the weights")
    p.add_argument("--repeats", type=int, default=3, help="timed repeats per call (median reported)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dw-scale", type=float, default=1e-3, help="elementwise RMS of each increment dW")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    args = p.parse_args(argv)
    for name in ("hidden", "num_heads", "kv_lora_rank", "d_nope", "head_chunk", "repeats"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    for name in ("q_lora_rank", "d_rope", "d_v"):
        if getattr(args, name) < 0:
            p.error(f"--{name.replace('_', '-')} must be >= 0")
    if args.baseline_heads is None:
        args.baseline_heads = args.num_heads
    if args.baseline_heads < 1:
        p.error("--baseline-heads must be >= 1")
    args.baseline_heads = min(args.baseline_heads, args.num_heads)
    return args


def make_layer(args: argparse.Namespace) -> tuple[MLAWeights, MLAWeights]:
    """Random prev/now weights (see the module doc), generated on the CPU (seeded), then moved."""
    gen = torch.Generator().manual_seed(args.seed)
    dtype, device = DTYPES[args.dtype], torch.device(args.device)

    def pair(rows: int, cols: int) -> tuple[torch.Tensor, torch.Tensor]:
        w = 0.02 * torch.randn(rows, cols, generator=gen)
        a = torch.randn(rows, 4, generator=gen)
        b = torch.randn(4, cols, generator=gen)
        dw = args.dw_scale * ((a @ b) / 2.0 + torch.randn(rows, cols, generator=gen)) / 2**0.5
        return w.to(device, dtype), (w + dw).to(device, dtype)

    def gamma(n: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = 1.0 + 0.1 * torch.randn(n, generator=gen)
        return g.to(device, dtype), (g + args.dw_scale * torch.randn(n, generator=gen)).to(device, dtype)

    d_qk = args.d_nope + args.d_rope
    t = {
        "kv_down": pair(args.kv_lora_rank + args.d_rope, args.hidden),
        "kv_up": pair(args.num_heads * (args.d_nope + args.d_v), args.kv_lora_rank),
        "kv_norm": gamma(args.kv_lora_rank),
    }
    if args.q_lora_rank:
        t["q_down"] = pair(args.q_lora_rank, args.hidden)
        t["q_up"] = pair(args.num_heads * d_qk, args.q_lora_rank)
        t["q_norm"] = gamma(args.q_lora_rank)
    else:
        t["q_proj"] = pair(args.num_heads * d_qk, args.hidden)
    return MLAWeights(**{k: v[0] for k, v in t.items()}), MLAWeights(**{k: v[1] for k, v in t.items()})


def _gamma64(g: torch.Tensor | None, n: int, like: torch.Tensor) -> torch.Tensor:
    return torch.ones(n, dtype=torch.float64, device=like.device) if g is None else g.to(torch.float64)


def _explicit(w: MLAWeights, heads: slice, args: argparse.Namespace) -> tuple[torch.Tensor, torch.Tensor]:
    """A_h, B_h of heads ``heads`` formed explicitly, float64 ``[c, d_qk, hidden]`` each."""
    f64, dn, dr = torch.float64, args.d_nope, args.d_rope
    d_qk, c = dn + dr, heads.stop - heads.start
    rows = slice(heads.start * d_qk, heads.stop * d_qk)
    if w.q_proj is not None:
        a = w.q_proj[rows].to(f64).reshape(c, d_qk, -1)
    else:
        assert w.q_up is not None and w.q_down is not None
        g_q = _gamma64(w.q_norm, w.q_down.shape[0], w.q_down)
        a = ((w.q_up[rows].to(f64) * g_q) @ w.q_down.to(f64)).reshape(c, d_qk, -1)
    r_kv = w.kv_up.shape[1]
    kup = w.kv_up.reshape(args.num_heads, -1, r_kv)[heads, :dn].to(f64)
    kvd = w.kv_down.to(f64)
    b_nope = (kup * _gamma64(w.kv_norm, r_kv, kvd)) @ kvd[:r_kv]
    return a, torch.cat([b_nope, kvd[r_kv:].expand(c, dr, kvd.shape[1])], dim=1)


def baseline(prev: MLAWeights, now: MLAWeights, args: argparse.Namespace, num_heads: int) -> dict[str, torch.Tensor]:
    """Explicit A_h, B_h per head chunk, then the classic compressed method in hidden space."""
    dn = args.d_nope
    out: dict[str, list[torch.Tensor]] = {"content": [], "whole": []}
    for start in range(0, num_heads, args.head_chunk):
        heads = slice(start, min(start + args.head_chunk, num_heads))
        a0, b0 = _explicit(prev, heads, args)
        a1, b1 = _explicit(now, heads, args)
        da, db = a1 - a0, b1 - b0
        x = torch.cat([da[:, :dn], a0[:, :dn], da[:, dn:], a0[:, dn:]], dim=1).mT  # [c, H, 2 d_qk]
        y = torch.cat([b0[:, :dn], db[:, :dn], b0[:, dn:], db[:, dn:]], dim=1).mT
        r_x = torch.linalg.qr(x, mode="r").R
        r_y = torch.linalg.qr(y, mode="r").R
        out["content"].append(torch.linalg.svdvals(r_x[:, : 2 * dn, : 2 * dn] @ r_y[:, : 2 * dn, : 2 * dn].mT))
        out["whole"].append(torch.linalg.svdvals(r_x @ r_y.mT))
    return {key: torch.cat(vals) for key, vals in out.items()}


def _qr_flops(m: int, n: int) -> float:
    """Householder QR (R only) of an ``m x n`` matrix."""
    if m >= n:
        return 2 * m * n**2 - 2 * n**3 / 3
    return 2 * n * m**2 - 2 * m**3 / 3


def flops(args: argparse.Namespace) -> dict[str, float]:
    """Analytic flop counts per layer: latent kernel (shared + per head) and explicit baseline."""
    h, r_q, r_kv, dn, dr = args.hidden, args.q_lora_rank, args.kv_lora_rank, args.d_nope, args.d_rope
    d_qk, n_kv = dn + dr, r_kv + dr
    m_kv = min(h, 2 * n_kv)
    cores = 2 * (2 * d_qk) ** 3 + 2 * (2 * dn) ** 3
    key_coeff = 2 * dn * r_kv * min(m_kv, r_kv) * 2 + 2 * dn * r_kv * m_kv
    shared = _qr_flops(h, 2 * n_kv)
    if r_q:
        m_q = min(h, 2 * r_q)
        shared += _qr_flops(h, 2 * r_q)
        query = 2 * d_qk * r_q * min(m_q, r_q) * 2 + 2 * d_qk * r_q * m_q + _qr_flops(m_q, 2 * d_qk)
        form_a = 2 * 2 * d_qk * r_q * h
    else:
        query, form_a = _qr_flops(h, 2 * d_qk), 0
    per_head = query + key_coeff + _qr_flops(m_kv, 2 * d_qk) + cores
    base_per_head = form_a + 2 * 2 * dn * r_kv * h + 2 * _qr_flops(h, 2 * d_qk) + cores
    return {
        "latent_shared": shared,
        "latent_per_head": per_head,
        "latent_total": shared + args.num_heads * per_head,
        "baseline_per_head": base_per_head,
        "baseline_total": args.num_heads * base_per_head,
    }


def timed(fn: Callable[[], object], repeats: int, device: torch.device) -> tuple[float, object]:
    """``bench_monitors.timed`` with this benchmark's slow-call limit."""
    return bench_monitors.timed(fn, repeats, slow_call_s=SLOW_CALL_S, device=device)


def max_rel_err(est: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> float:
    worst = 0.0
    for key, r in ref.items():
        e = est[key][: r.shape[0]]
        r = _fit(r, e.shape[-1])
        mask = (r >= REL_FLOOR * r.amax(dim=-1, keepdim=True)) & (r > 0)
        if mask.any():
            worst = max(worst, ((e - r).abs()[mask] / r[mask]).max().item())
    return worst


def run(args: argparse.Namespace) -> dict:
    device = torch.device(args.device)
    prev, now = make_layer(args)
    kw = dict(d_nope=args.d_nope, d_rope=args.d_rope, num_heads=args.num_heads, head_chunk=args.head_chunk)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    t_latent, got = timed(lambda: mla_delta2_singular_values(prev, now, **kw), args.repeats, device)
    peak_latent = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    nb = args.baseline_heads
    t_base, ref = timed(lambda: baseline(prev, now, args, nb), args.repeats, device)
    peak_base = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    t_base_layer = t_base * args.num_heads / nb
    assert isinstance(got, dict) and isinstance(ref, dict)
    fl = flops(args)
    return {
        "config": {
            "hidden": args.hidden,
            "num_heads": args.num_heads,
            "q_lora_rank": args.q_lora_rank or None,
            "kv_lora_rank": args.kv_lora_rank,
            "d_nope": args.d_nope,
            "d_rope": args.d_rope,
            "d_v": args.d_v,
            "head_chunk": args.head_chunk,
            "dtype": args.dtype,
            "dw_scale": args.dw_scale,
            "seed": args.seed,
            "repeats": args.repeats,
            "device": str(device),
        },
        "times_s": {"mla_latent": t_latent, "explicit_baseline": t_base_layer},
        "baseline_heads_timed": nb,
        "baseline_timed_s": t_base,
        "baseline_scaled": nb < args.num_heads,
        "speedup_vs_baseline": t_base_layer / t_latent,
        "max_rel_err": max_rel_err(got, ref),
        "rel_err_floor": REL_FLOOR,
        "spectrum_lengths": {key: got[key].shape[-1] for key in got},
        "flops": fl,
        "flop_ratio_baseline_over_latent": fl["baseline_total"] / fl["latent_total"],
        "peak_cuda_bytes": {"mla_latent": peak_latent, "explicit_baseline": peak_base},
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_name(),
        **bench_monitors.environment(),
    }


def print_table(report: dict) -> None:
    cfg = report["config"]
    print(
        f"MLA layer: hidden={cfg['hidden']} heads={cfg['num_heads']} q_lora={cfg['q_lora_rank']} "
        f"kv_lora={cfg['kv_lora_rank']} d_nope={cfg['d_nope']} d_rope={cfg['d_rope']} on {report['device_name']} "
        f"| torch {report['torch_version']}, {report['threads']} threads"
    )
    print(f"{'kernel':<28}{'time/layer [s]':>16}{'Gflop':>12}")
    gflop = {"mla_latent": report["flops"]["latent_total"], "explicit_baseline": report["flops"]["baseline_total"]}
    for name, t in report["times_s"].items():
        note = " (scaled)" if name == "explicit_baseline" and report["baseline_scaled"] else ""
        print(f"{name + note:<28}{t:>16.4f}{gflop[name] / 1e9:>12.1f}")
    print(f"speedup {report['speedup_vs_baseline']:.1f}x, max rel err {report['max_rel_err']:.1e}")


def main(argv: Sequence[str] | None = None) -> dict:
    """Run the benchmark; print JSON (``--json``) or a table; return the report dict."""
    args = parse_args(argv)
    report = run(args)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print_table(report)
    return report


if __name__ == "__main__":
    main()
