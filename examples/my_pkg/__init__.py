"""A small user package: a model and a dataset that gradmod builds from ``_target_``."""
