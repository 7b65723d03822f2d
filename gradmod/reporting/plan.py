"""The hook plan for the console: one line per rule, however many tensors it matches.

``hook_plan.json`` in the run folder keeps the full plan (one entry per tensor and rule);
the console gets ``clip: 161 tensors matching '*' -> clamp(min=-0.01, max=0.01)``, so a
ResNet-50 run (or every job of a sweep) does not open with a screen of near-identical lines.
"""

from __future__ import annotations

from typing import Any, Mapping

from gradmod.hooks import stages

LIST_UP_TO = 3  # a rule matching this many tensors or fewer names them


def summarize_plan(plan: list[dict[str, Any]], rules: Mapping[str, Any]) -> str:
    """``plan`` as ``HookSet.describe()`` gives it; ``rules`` the rule configs (for their patterns)."""
    if not plan:
        return "hook plan: no rules"
    by_rule: dict[str, list[dict[str, Any]]] = {}
    for row in plan:
        by_rule.setdefault(row["rule"], []).append(row)
    lines = [_rule_line(name, rows, rules.get(name) or {}) for name, rows in by_rule.items()]
    return "hook plan (full plan: hook_plan.json):\n" + "\n".join(lines)


def _rule_line(name: str, rows: list[dict[str, Any]], rule: Mapping[str, Any]) -> str:
    first = rows[0]
    stage = f" [{first['stage']}]" if stages.get(first["stage"]).plan_tag else ""
    transforms = " -> ".join(first["transforms"])
    if "active" in first:  # a window: when the rule acts, in optimizer steps completed
        transforms += f" (active steps {first['active']})"
    if len(rows) <= LIST_UP_TO:
        return f"  {name}{stage}: {', '.join(r['tensor'] for r in rows)} -> {transforms}"
    kind = "module outputs" if rule.get("modules") is not None else "tensors"
    pattern = rule.get("modules") if rule.get("modules") is not None else rule.get("params")
    matching = f" matching {_patterns(pattern)}" if pattern is not None else ""
    if rule.get("exclude") is not None:
        matching += f" except {_patterns(rule['exclude'])}"
    return f"  {name}{stage}: {len(rows)} {kind}{matching} -> {transforms}"


def _patterns(value: Any) -> str:
    if isinstance(value, str):
        return repr(value)
    return ", ".join(repr(str(v)) for v in value)
