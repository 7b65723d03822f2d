"""JSON text that every parser reads: a non-finite float (nan, inf) is written as ``null``.

Python's ``json`` writes ``NaN`` and ``Infinity``, which are not JSON; a diverged run's
numbers must still leave files that ``jq``, JavaScript or ``json.loads(strict)`` read.
"""

from __future__ import annotations

import json
import math
from typing import Any


def finite_or_none(obj: Any) -> Any:
    """``obj`` with every non-finite float replaced by None (dicts, lists and tuples walked)."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: finite_or_none(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [finite_or_none(v) for v in obj]
    return obj


def dumps(obj: Any, **kwargs: Any) -> str:
    """``json.dumps`` for files: non-finite floats as null, anything else non-JSON refused."""
    return json.dumps(finite_or_none(obj), allow_nan=False, **kwargs)
