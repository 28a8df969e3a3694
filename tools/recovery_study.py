"""Recovery study: none / today's practice / mechmon's loop on the same fault runs.

    python tools/recovery_study.py run --out ../recovery_runs/study --cells fa:32:500:1,moe-lr:1
    python tools/recovery_study.py table [--records docs/data/recovery_study]
    python tools/recovery_study.py plot --to docs/img/recovery/recovery_runs.png [--cells fa-s32-on500-seed3,...]

``run`` trains what is missing, one launch at a time (the clean run of each seed first), resumes
every launch a killed run left (from its own newest checkpoint), and writes one JSON record per
cell to ``--records``; ``table`` prints the markdown table of the records, ``plot`` draws their
loss curves (one panel per cell, records written with curves only). Keep ``--out`` outside
the repository (checkpoints). See mechmon_megatron/research/recovery_study/ and docs/RECOVERY.md.
"""

from __future__ import annotations

import argparse
import os
import sys

from mechmon_megatron.research.recovery_study.campaign import (
    OPERATORS,
    parse_cell,
    run_cell,
    summarize,
    write_record,
)
from mechmon_megatron.research.recovery_study.table import load_records, markdown_table
from mechmon_megatron.research.study.runner import exit_on_sigterm

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RECORDS = os.path.join(ROOT, "docs", "data", "recovery_study")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    run = sub.add_parser("run", help="train the cells (resumable) and write their records")
    run.add_argument("--out", required=True, help="run folders (checkpoints): outside the repository")
    run.add_argument("--cells", required=True, help="comma-separated fa:STRENGTH:ONSET:SEED or moe-lr:SEED, in order")
    run.add_argument("--operators", default=",".join(OPERATORS), help=f"subset of {','.join(OPERATORS)}")
    run.add_argument("--records", default=RECORDS, help="where the JSON records go (default docs/data/recovery_study)")
    table = sub.add_parser("table", help="print the markdown table of the records")
    table.add_argument("--records", default=RECORDS)
    plot = sub.add_parser("plot", help="draw the records' loss curves, one panel per cell")
    plot.add_argument("--records", default=RECORDS)
    plot.add_argument("--to", required=True, help="PNG file to write")
    plot.add_argument("--cells", default=None, help="comma-separated cell ids, in panel order (default: every record)")
    record = sub.add_parser("record", help="write the records of cells as they stand (no training)")
    record.add_argument("--out", required=True)
    record.add_argument("--cells", required=True)
    record.add_argument("--records", default=RECORDS)
    args = p.parse_args(argv)
    if args.cmd == "table":
        print(markdown_table(load_records(args.records)))
        return 0
    if args.cmd == "plot":
        from mechmon_megatron.research.recovery_study.plots import plot_recovery

        records = {r["cell"]: r for r in load_records(args.records)}
        wanted = [c.strip() for c in args.cells.split(",") if c.strip()] if args.cells else list(records)
        unknown = [c for c in wanted if c not in records]
        if unknown:
            p.error(f"--cells: no record for {unknown}; the records hold {sorted(records)}")
        try:
            left_out = plot_recovery([records[c] for c in wanted], args.to)
        except ValueError as exc:
            p.error(str(exc))
        print(f"wrote {args.to}" + (f"; left out (no curves in their records): {', '.join(left_out)}"
                                     if left_out else ""))
        return 0
    if args.cmd == "record":
        for text in args.cells.split(","):
            print(write_record(summarize(args.out, parse_cell(text.strip())), args.records, args.out))
        return 0
    try:
        cells = [parse_cell(c.strip()) for c in args.cells.split(",") if c.strip()]
    except ValueError as exc:
        p.error(str(exc))
    operators = tuple(o.strip() for o in args.operators.split(",") if o.strip())
    unknown = [o for o in operators if o not in OPERATORS]
    if unknown:
        p.error(f"--operators: unknown {unknown}; choose from {OPERATORS}")
    exit_on_sigterm()  # a kill stops the running launch's processes; the next run resumes it
    for cell in cells:
        print(f"[recovery-study] {cell.cell_id}: {', '.join(operators)}", flush=True)
        record = run_cell(args.out, cell, operators, args.records)
        print(f"[recovery-study] wrote {write_record(record, args.records, args.out)}", flush=True)
    print(markdown_table(load_records(args.records)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
