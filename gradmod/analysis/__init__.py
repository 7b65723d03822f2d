"""Analyses of a finished run, read from its folder through ``gradmod.run.folder``:
``self_influence`` (TracIn over the run's checkpoints) and ``score_report`` (``gradmod scores RUN``)."""
