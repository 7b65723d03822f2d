"""The console's one line per epoch: what someone watching a run, or reading its redirected
output, needs to see that it goes on and how well."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

BOOKKEEPING = ("epoch", "step", "seconds", "train_seconds", "eval_seconds", "skipped_steps")


def epoch_line(numbers: Mapping[str, Any], epochs: int | None = None) -> str:
    """``epoch 2/10: train_loss 0.4123 test_loss 0.3981 test_accuracy 0.8812 epsilon 1.234 (3.1 s)``:
    every number of an epoch's record in its order (losses, test metrics, epsilon: whatever
    the record holds) but the bookkeeping; skipped steps where there were some."""
    head = f"epoch {numbers.get('epoch', '?')}" + (f"/{epochs}" if epochs else "")
    shown = [f"{key} {_number(value)}" for key, value in numbers.items()
             if key not in BOOKKEEPING and _is_number(value)]
    if numbers.get("skipped_steps"):
        shown.append(f"skipped_steps {numbers['skipped_steps']}")
    seconds = numbers.get("seconds")
    return f"{head}: {' '.join(shown)}" + (f" ({seconds:.1f} s)" if _is_number(seconds) else "")


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _number(value: float) -> str:
    return str(value) if isinstance(value, int) else f"{value:.4g}"
