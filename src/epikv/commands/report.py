"""`epikv report`: markdown + CSV tables and PNG plots from `epikv eval` and `epikv retention` output directories."""

from __future__ import annotations


def register(sub) -> None:
    from .common import out_dir

    p = sub.add_parser("report", help="tables and plots from eval and retention output directories",
                       description="Merge the records of one or more `epikv eval` directories into report.md, "
                                   "report.csv, accuracy_vs_budget.png and speed_vs_budget.png; and those of "
                                   "`epikv retention` directories into retention.md, retention_summary.json and "
                                   "retention_<metric>.png.")
    p.add_argument("dirs", nargs="+", help="eval or retention output directories")
    p.add_argument("--out", default=None, type=out_dir, help="where to write the report (default: the first directory)")
    p.add_argument("--reference", default=None, metavar="POLICIES",
                   help="retention: the policies every other is compared with, paired on common traces "
                        "(comma-separated row labels such as epikv@tau=128; each must be in the records; default "
                        "epikv,random, those of them present)")
    p.set_defaults(run=run)


def run(args) -> int:
    from pathlib import Path

    from ..errors import EpiKVError
    from ..eval.report import merge, summarize, table_text, write_report
    from ..retention.bootstrap import unique
    from ..retention.report import render_retention
    from ..retention.store import read_records

    for d in args.dirs:
        if not Path(d).is_dir():
            raise EpiKVError(f"{d} is not a directory")
    # a retention run keeps its records in results.jsonl with "kind": "retention"
    retention = [d for d in args.dirs if (Path(d) / "results.jsonl").exists()]
    evals = [d for d in args.dirs if d not in retention]
    references = tuple(x.strip() for x in (args.reference or "epikv,random").split(",") if x.strip())
    if args.reference is not None and not retention:
        raise EpiKVError("--reference applies to retention directories (with results.jsonl); none was given")
    records = [r for d in retention for r in read_records(Path(d) / "results.jsonl")]
    if args.reference is not None:  # a reference asked for by name must exist: a typo is not a missing table
        labels = {r["label"] for r in unique(records)}
        unknown = [x for x in references if x not in labels] if references else ["(empty)"]
        if unknown:
            raise EpiKVError(f"--reference {','.join(unknown)}: no such policy row in the retention records "
                             f"(they hold {', '.join(sorted(labels)) or 'none'})")
    if args.out is None:  # the report goes into the first directory of each kind: it must be writable
        import argparse

        from .common import check_writable

        for d in dict.fromkeys(x[0] for x in (retention, evals) if x):
            try:
                check_writable(Path(d))
            except argparse.ArgumentTypeError as e:
                raise EpiKVError(f"report (no --out: into {d}): {e}") from None
    if retention:
        for path in render_retention(records, args.out or retention[0], reference=references):
            print(f"retention: {path}")
    if not evals:
        return 0
    paths = write_report(evals, args.out)
    print(table_text(summarize(merge(evals)[0])))
    for kind, path in paths.items():
        print(f"{kind}: {path}")
    return 0
