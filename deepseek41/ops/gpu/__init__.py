"""The GPU's kernels: Pallas on the Triton backend, each held equal to its op's plain jnp reference
(the op's module one level up dispatches to it). Every kernel launches through ops/launch.py."""
