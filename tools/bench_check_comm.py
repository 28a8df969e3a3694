"""What one check costs in communication, rank by rank, as the job grows.

Launches the example trainer (tiny MoE GPT, a few checks) under torchrun on 2, 4, 8 and 16 gloo
processes on CPU and records, per check and per rank, the bytes that rank's monitor collectives
sent and received, the peers it received from (``messages``: a gather's root counts each other
rank of its group, a broadcast's receiver one; all-reduces count none) and their wall time (the
session's byte counter, ``CollectiveGuard.counter``: logical payload, what a rank contributes and
what it obtains from other ranks). Layout: tensor
parallel 2 with sequence parallelism, pipeline 1, data parallel ``N / 2``: the layers' owners
(per-head replica ``(L - 1) % dp``, full-matrix rank ``(L - 1) % (dp * tp)``, the routers' reporting
rank) stay the same few ranks while the world grows, so a check's traffic should not grow with
``N`` beyond them.

    python tools/bench_check_comm.py --ranks 2,4,8,16 --out bench_check_comm.json

Each run is ``nice``'d; the JSON holds, per world size, every rank's per-check counts and a
summary (``writer_bytes``: the writer rank's sent + received per check, ``max_other_bytes``: the
largest over the other ranks, ``writer_messages`` / ``max_other_messages``: the peers they received
from, ``max_seconds``: the slowest rank's collective time per check).
Timings on a shared machine are only indicative; the byte counts are exact.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

HERE = Path(__file__).resolve().parent
DRIVER = HERE / "_check_comm_driver.py"
MODEL = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
         "--micro-batch-size", "1", "--num-experts", "4", "--moe-router-topk", "2", "--use-cpu-initialization",
         "--seed", "3", "--corpus-max-bytes", "20000", "--tensor-model-parallel-size", "2", "--sequence-parallel",
         "--distributed-timeout-minutes", "10"]


def run_world(nproc: int, iters: int, interval: int, timeout_s: float, workdir: Path) -> dict[str, Any]:
    """One torchrun job of ``nproc`` ranks; every rank's per-check counts and the summary."""
    out = workdir / f"comm{nproc}"
    dp = nproc // 2
    cmd = ["nice", "-n", "10", sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
           str(nproc), str(DRIVER), *MODEL, "--global-batch-size", str(dp), "--train-iters", str(iters),
           "--mechmon", "--mechmon-interval", str(interval), "--mechmon-delta", str(interval)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MECHMON_COMM_OUT": str(out)}
    start = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout_s)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        raise RuntimeError(f"{nproc} ranks: exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    ranks = {}
    for rank in range(nproc):
        path = Path(f"{out}.rank{rank}.jsonl")
        ranks[rank] = [json.loads(line) for line in path.read_text().splitlines()]
    writer = nproc - 1  # the example trainer writes on the last rank, as Megatron does
    return {"ranks": nproc, "layout": {"tp": 2, "pp": 1, "dp": dp, "sequence_parallel": True},
            "wall_s": round(wall, 1), "per_rank": ranks, "summary": summarize(ranks, writer),
            "planned": planned(dp)}


def planned(dp: int) -> dict[str, Any]:
    """``mechmon-plan``'s count of the same check (``plan/comm.py``) for comparison."""
    from mechmon_megatron.plan.comm import check_comm_bytes
    from mechmon_megatron.plan.shapes import ModelShape, ParallelLayout

    shape = ModelShape(name="bench", num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=4,
                       kv_channels=8, ffn_hidden_size=128, vocab_size=256, seq_length=16, micro_batch_size=1,
                       global_batch_size=dp, num_experts=4, moe_router_topk=2)
    return check_comm_bytes(shape, ParallelLayout(tp=2, pp=1, dp=dp))


def summarize(ranks: dict[int, list[dict]], writer: int) -> dict[str, Any]:
    """The last check (steady state: the first one also sends each reporting rank's schema), for
    ``records`` (the records to the writer, the decision back, the end-of-step agreement) and
    ``reads`` (the weights' gathers and the routers' all-reduces): the writer's bytes, the largest
    and the median non-writer's, and the slowest rank's collective seconds; ``first_check``: the
    writer's and the largest other rank's records bytes at the first check."""
    out: dict[str, Any] = {"checks": len(ranks[writer]), "writer_rank": writer}
    first = {r: rows[0]["records"]["sent_bytes"] + rows[0]["records"]["received_bytes"] for r, rows in ranks.items()}
    out["first_check"] = {"writer_bytes": first[writer],
                          "max_other_bytes": max((b for r, b in first.items() if r != writer), default=0)}
    ranks = {r: rows[-1:] for r, rows in ranks.items()}
    for part in ("records", "reads"):
        def per_check(rows: list[dict], part: str = part) -> float:
            return statistics.fmean(r[part]["sent_bytes"] + r[part]["received_bytes"] for r in rows) if rows else 0.0

        others = {r: per_check(rows) for r, rows in ranks.items() if r != writer}
        busiest = max(others, key=lambda r: others[r]) if others else None
        seconds = [max(r[part]["seconds"] for r in rows) for rows in ranks.values() if rows]
        out[part] = {
            "writer_bytes": round(per_check(ranks[writer])),
            "writer_sent_bytes": round(statistics.fmean(r[part]["sent_bytes"] for r in ranks[writer])),
            "writer_received_bytes": round(statistics.fmean(r[part]["received_bytes"] for r in ranks[writer])),
            "max_other_bytes": round(others[busiest]) if busiest is not None else 0,
            "max_other_rank": busiest,
            "median_other_bytes": round(statistics.median(others.values())) if others else 0,
            "min_other_bytes": round(min(others.values())) if others else 0,
            "max_seconds": round(max(seconds), 4) if seconds else 0.0,
            "writer_messages": round(statistics.fmean(r[part].get("messages", 0) for r in ranks[writer])),
            "max_other_messages": max((round(statistics.fmean(r[part].get("messages", 0) for r in rows))
                                       for rank, rows in ranks.items() if rank != writer and rows), default=0),
        }
    return out


def markdown(results: list[dict]) -> str:
    lines = ["| ranks | layout | records: writer B / check (planned) | records: largest other rank (planned) | "
             "records: smallest other rank | records: peers the writer receives from (planned) / largest other | "
             "records, first check: writer / largest other | reads: largest rank B / check | "
             "slowest rank's collectives / check |",
             "|---|---|---|---|---|---|---|---|---|"]
    for res in results:
        rec, rd, lay = res["summary"]["records"], res["summary"]["reads"], res["layout"]
        first, plan = res["summary"]["first_check"], res["planned"]
        reads = max(rd["writer_bytes"], rd["max_other_bytes"])
        seconds = rec["max_seconds"] + rd["max_seconds"]
        lines.append(f"| {res['ranks']} | TP {lay['tp']} x DP {lay['dp']} (SP) | {rec['writer_bytes']:,} "
                     f"({plan['writer']:,}) | {rec['max_other_bytes']:,} ({plan['per_rank']:,}) | "
                     f"{rec['min_other_bytes']:,} | {rec['writer_messages']} ({plan['writer_messages']}) / "
                     f"{rec['max_other_messages']} | {first['writer_bytes']:,} / {first['max_other_bytes']:,} | "
                     f"{reads:,} | {seconds * 1000:.1f} ms |")
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ranks", default="2,4,8,16", help="World sizes (even: TP 2 x DP N/2).")
    parser.add_argument("--iters", type=int, default=6)
    parser.add_argument("--interval", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=900.0, help="Seconds per world size.")
    parser.add_argument("--out", default=None, help="JSON output (default: stdout only).")
    args = parser.parse_args(argv)
    results = []
    with tempfile.TemporaryDirectory(prefix="mechmon-comm-") as tmp:
        for nproc in (int(n) for n in args.ranks.split(",")):
            try:
                res = run_world(nproc, args.iters, args.interval, args.timeout, Path(tmp))
            except (RuntimeError, subprocess.TimeoutExpired) as exc:
                print(f"[bench_check_comm] {nproc} ranks did not finish: {str(exc)[:2000]}", file=sys.stderr)
                results.append({"ranks": nproc, "error": str(exc)[:2000]})
                continue
            print(f"[bench_check_comm] {nproc} ranks: {json.dumps(res['summary'])} ({res['wall_s']} s)",
                  file=sys.stderr, flush=True)
            results.append(res)
    done = [r for r in results if "summary" in r]
    report = {"results": results, "markdown": markdown(done),
              "note": "bytes: logical payload of mechmon's collectives per check (exact); seconds: a shared "
                      "CPU machine, indicative only"}
    text = json.dumps(report, indent=1)
    if args.out:
        Path(args.out).write_text(text + "\n", encoding="utf-8")
    print(markdown(done))
    return 0 if len(done) == len(results) else 1


if __name__ == "__main__":
    sys.exit(main())
