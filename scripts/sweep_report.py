"""Rebuild a sweep's report: ``python scripts/sweep_report.py multirun/2024-01-01/12-00-00``.

Writes ``sweep.csv``, ``sweep.md`` and ``sweep_curves.png`` into the sweep folder (as the
callback does at the end of a multirun) and prints the Markdown table. Works on a sweep
that is still running or was killed: a job whose process is alive is listed as running,
one whose process is gone without an ending as killed.
"""

import argparse
import sys

from gradmod.reporting.sweep_report import write_report


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("path", help="the sweep folder (Hydra's hydra.sweep.dir)")
    parser.add_argument("--metric", default="auto", help="what ranks the groups (as report.metric)")
    parser.add_argument("--direction", default="auto", help="auto | higher | lower (as report.direction)")
    args = parser.parse_args()
    try:
        paths, rows = write_report(args.path, metric=args.metric, direction=args.direction)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(paths["md"].read_text())
    print("wrote " + ", ".join(str(p) for p in paths.values()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
