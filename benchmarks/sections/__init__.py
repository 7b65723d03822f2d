"""The sections that run as programs of their own too (``python -m benchmarks.sections.NAME``):
each times its contenders against a baseline in the same process, and the driver
(``benchmarks.cli``) runs them as named sections."""
