"""Training: loop, steps, losses, optimizer, checkpoints, metrics, MFU accounting."""
