"""The per_loss methods: from k task gradients (or k losses) to one update.

``bases`` holds the face every method shares (``Method``; ``GramianWeighting``, ``Aggregator``,
``LossWeighting``), then a file per family:

- Gramian weightings, weights from the k x k task Gramian: ``gramian_weightings`` (PCGrad, MGDA,
  IMTL-G, Aligned-MTL, UPGrad, DualProj, CAGrad, GradVac), ``nash_mtl``, ``pcd``; ``solvers``: the
  small exact solvers they share; ``rounding``: the rounding a Gramian carries, for those that
  decide its rank.
- Aggregators, the update from the task gradients themselves: ``aggregators`` (ConFIG, FairGrad,
  Krum, TrimmedMean, ExcessMTL), ``graddrop``.
- Loss weightings, weights from the loss values alone: ``loss_weightings`` (mean, sum, fixed,
  random, geometric mean, UW, FAMO, DWA), ``scalarizations`` (COSMOS, IMTL-L, PBI, STCH).
- Weightings learned across steps: ``simplex_steps`` (MoDo, SDMGrad, CR-MOGM).

``gradmod.register(name, factory, kind="per_loss")`` adds one of one's own.
"""
