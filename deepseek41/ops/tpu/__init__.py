"""The TPU's kernels: Pallas on the Mosaic backend (jax's megablox grouped GEMM, the indexer
scores), each held equal to its op's plain jnp reference."""
