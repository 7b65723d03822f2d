"""Tools for tests and benchmarks: count the ops a step dispatches (``opcount``), run one bare
training epoch (``epochs``), write MNIST's raw files (``mnist_files``).

Only ``OpCounter`` is imported here: ``gradmod.testing.epochs`` imports the training floor,
so it is imported by name where it is used.
"""

from gradmod.testing.opcount import OpCounter

__all__ = ["OpCounter"]
