"""How a rule's transforms are written, read in one place (torch-free: the command line's
checks read it before torch loads).

A rule's ``transforms`` is one transform or a list of them; a transform is a name
(``"zero"``) or a mapping with ``name`` and its arguments (``{name: clamp, min: -0.01}``).
"""

from __future__ import annotations

from typing import Any, Mapping


def transform_list(transforms: Any) -> Any:
    """A rule's transforms as a list: one name or mapping is a list of one (anything else
    is returned as it is, for the caller to refuse)."""
    return [transforms] if isinstance(transforms, (str, Mapping)) else transforms


def parse_spec(spec: str | Mapping[str, Any]) -> tuple[str, dict[str, Any]]:
    """``"zero"`` or ``{"name": "clamp", "min": ..., "max": ...}`` -> (name, args)."""
    if isinstance(spec, str):
        return spec, {}
    if isinstance(spec, Mapping) and isinstance(spec.get("name"), str):
        args = {str(k): v for k, v in spec.items() if k != "name"}
        return spec["name"], args
    raise ValueError(f"a transform must be a name or a mapping with 'name' and its arguments, got {spec!r}")
