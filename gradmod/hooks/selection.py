"""The rule parsing's former home: its names, importable from here as before
(``gradmod.hooks.rules`` holds them)."""

from gradmod.hooks.rules import DEFAULT_STAGES, Target, build_targets, load_rules, name_hint, select

__all__ = ["DEFAULT_STAGES", "Target", "build_targets", "load_rules", "name_hint", "select"]
