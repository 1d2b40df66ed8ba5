"""Flax NNX modules of the V4.1 backbone (one concern per file)."""
