"""``gradmod scores RUN``: TracIn self-influence of a finished run's training examples over its
checkpoints, into the run folder (``gradmod.analysis.score_report``; docs/guide/scores.md).

Bad input ends in one line on stderr: exit 2 (not a run folder, a run still training, no
checkpoints, one of another model, data that is not the run's, a value out of range), exit 1
for a file that cannot be read or written. Progress goes to stderr as log lines.
"""

from __future__ import annotations

import argparse
import logging
import sys

from gradmod.app.command_lines import parser, reported

USAGE = "gradmod scores RUN [--data-dir DIR] [--batch-size N] [--top K] [--device auto|cpu|cuda]"


def parse(argv: list[str]) -> argparse.Namespace:
    p = parser(
        "scores",
        USAGE,
        "TracIn self-influence of a run's training examples over its checkpoints "
        "(sum over checkpoints of lr x |loss gradient|^2): self_influence.csv, hardest.png and two plots "
        "in the run folder",
    )
    p.add_argument("run", help="the run folder (its checkpoints/ are read)")
    p.add_argument("--data-dir", default=None, help="where the run's data lies now (default: the run's data_dir)")
    p.add_argument("--batch-size", type=int, default=100, help="examples per backward (default 100)")
    p.add_argument("--top", type=int, default=24, help="images in hardest.png (default 24)")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N (default auto)")
    return p.parse_args(argv)


def main(argv: list[str]) -> int:
    args = parse(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    from gradmod.analysis.score_report import score_run

    result = reported(
        "scores",
        lambda: score_run(
            args.run, data_dir=args.data_dir, batch_size=args.batch_size, top=args.top, device=args.device
        ),
    )
    if isinstance(result, int):
        return result
    top = ", ".join(f"{t['index']} ({t['label']}/{t['prediction']})" for t in result["top"][:8])
    print(f"highest self-influence (index (label/prediction)): {top}")
    print("mean by class: " + ", ".join(f"{c}: {m:.3g}" for c, m in result["mean_by_class"].items()))
    print("wrote " + ", ".join(result["files"]))
    return 0
