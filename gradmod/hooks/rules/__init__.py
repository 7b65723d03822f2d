"""What a rule selects and when it acts: ``targets`` (a rule's tensors and transforms, ``load_rules``),
``globs`` (patterns and selectors, shared with optimizer groups), ``shared`` (``@shared``: what
every task's loss reaches), ``syntax`` (how a rule's transforms are written, torch-free), ``sources``
(hook config files), ``timed`` (scheduled arguments and ``active`` windows) and ``switched`` (what
a live ``freeze`` turned off). Nothing is imported here, so ``gradmod.optim`` reads ``globs`` alone."""
