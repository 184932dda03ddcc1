"""On-disk state of a run: atomic files, checkpoints, activation stores, stage records."""
