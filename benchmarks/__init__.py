"""gradmod's benchmarks, run from a checkout: ``python -m benchmarks [SECTION ...]``.

``cli`` reads the command line and runs the sections; ``timing`` times the contenders in
one process and forms paired ratios; ``ratios`` holds the reported ratios and their targets;
``contenders`` gathers every timed section's contenders; ``memory`` the sections' peak
memory (``peak_memory``: one contender in a fresh process); ``report`` the machine and the
table; ``mnist`` (epoch, eval, step) and ``ops`` time the MNIST CNN. ``sections/`` holds the
sections that also run on their own (``scale``, ``per_sample``, ``per_loss``, ``sharpness``,
``freeze``, ``orthogonalize``, ``sam_peers``, ``scores``, and ``optim``, Muon's step against
AdamW's: ``python -m benchmarks.sections.optim``).
"""
