"""Tools for tests and benchmarks: count the ops a step dispatches."""

from gradmod.testing.opcount import OpCounter

__all__ = ["OpCounter"]
