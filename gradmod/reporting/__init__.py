"""What a run leaves behind: run-folder files, loggers, plots and the sweep report."""
