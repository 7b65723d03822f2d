"""``gradmod influence RUN``: which training examples helped and harmed a finished run's test
predictions, by TracIn over its checkpoints, into the run folder
(``gradmod.analysis.influence_report``; docs/guide/scores.md).

Bad input ends in one line on stderr: exit 2 (not a run folder, a run still training, no
checkpoints, a test index out of range, a glob matching nothing, a value out of range), exit 1
for a file that cannot be read or written. Progress goes to stderr as log lines.
"""

from __future__ import annotations

import argparse
import logging
import sys

from gradmod.app.command_lines import parser, reported

USAGE = (
    "gradmod influence RUN [--test I,J,...|--hardest N] [--k K] [--params GLOB ...] [--projection D] "
    "[--check N] [--data-dir DIR] [--batch-size N] [--device auto|cpu|cuda] [--seed S]"
)


def _indices(text: str) -> list[int]:
    try:
        return [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of test indices") from None


def parse(argv: list[str]) -> argparse.Namespace:
    p = parser(
        "influence",
        USAGE,
        "TracIn influence of a run's training examples on test examples over its checkpoints "
        "(sum over checkpoints of lr x test gradient . training gradient): the k most helpful and most harmful "
        "training examples of each, into influence.csv and influence.png in the run folder",
    )
    p.add_argument("run", help="the run folder (its checkpoints/ are read)")
    p.add_argument(
        "--test", type=_indices, default=None, help="test examples by index, e.g. 3,17 (default: the hardest)"
    )
    p.add_argument(
        "--hardest", type=int, default=8, help="without --test: the N test examples of highest loss (default 8)"
    )
    p.add_argument("--k", type=int, default=8, help="proponents and opponents per test example (default 8)")
    p.add_argument(
        "--params", nargs="+", default=["*"], help="the parameters read, by glob (Captum's layers=; default *)"
    )
    p.add_argument(
        "--projection", type=int, default=None, help="project the gradients to D dimensions (default: exact)"
    )
    p.add_argument(
        "--check", type=int, default=1000, help="projected: training examples scored exactly too (default 1000)"
    )
    p.add_argument("--data-dir", default=None, help="where the run's data lies now (default: the run's data_dir)")
    p.add_argument("--batch-size", type=int, default=100, help="training examples per batch (default 100)")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N (default auto)")
    p.add_argument("--seed", type=int, default=0, help="the projection's and the check's random draws (default 0)")
    return p.parse_args(argv)


def main(argv: list[str]) -> int:
    args = parse(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    from gradmod.analysis.influence_report import influence_run

    result = reported(
        "influence",
        lambda: influence_run(
            args.run,
            test=args.test,
            hardest=args.hardest,
            k=args.k,
            params=args.params,
            projection=args.projection,
            check=args.check,
            data_dir=args.data_dir,
            batch_size=args.batch_size,
            device=args.device,
            seed=args.seed,
        ),
    )
    if isinstance(result, int):
        return result
    for t in result["tests"]:
        print(
            f"test {t['index']} ({t['label']}/{t['prediction']}): proponents {', '.join(map(str, t['proponents']))}; "
            f"opponents {', '.join(map(str, t['opponents']))}"
        )
    if result["projection"] is not None:
        e = result["projection"]
        print(
            f"projection against exact on {e['examples']} training examples: Spearman over the top 100 "
            f"{e['spearman_min']:.3f} (lowest), {e['spearman_mean']:.3f} (mean); relative error {e['relative_error']:.3g}"
        )
    print("wrote " + ", ".join(result["files"]))
    return 0
