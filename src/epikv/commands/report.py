"""`epikv report`: markdown + CSV tables and PNG plots from one or more `epikv eval` output directories."""

from __future__ import annotations


def register(sub) -> None:
    p = sub.add_parser("report", help="tables and plots from eval output directories",
                       description="Merge the records of one or more `epikv eval` directories into report.md, "
                                   "report.csv, accuracy_vs_budget.png and speed_vs_budget.png.")
    p.add_argument("dirs", nargs="+", help="eval output directories")
    p.add_argument("--out", default=None, help="where to write the report (default: the first directory)")
    p.set_defaults(run=run)


def run(args) -> int:
    from ..eval.report import merge, summarize, table_text, write_report

    paths = write_report(args.dirs, args.out)
    print(table_text(summarize(merge(args.dirs)[0])))
    for kind, path in paths.items():
        print(f"{kind}: {path}")
    return 0
