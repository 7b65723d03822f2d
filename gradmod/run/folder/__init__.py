"""The run folder: what a run writes and when. ``claim`` (the folder owned for the run's lifetime,
no write before every check passed), ``atomic`` (a file whole or not at all), ``checkpoint_file``
and ``checkpointing`` (checkpoints and their callback), ``writers`` (metrics, statistics, plots, the
final model), ``score_files`` and ``scores_csv`` (the per-example score files), ``endings`` (every
ending's ``summary.json``)."""
