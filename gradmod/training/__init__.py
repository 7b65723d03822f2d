"""The trainer: the epoch loop, checkpoints, precision, non-finite policy, DDP, data placement."""
