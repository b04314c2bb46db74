"""Training: the ``train`` job runner, its loop, optimizer and LR schedule, batches, metrics."""
