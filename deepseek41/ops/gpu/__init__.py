"""The GPU's kernels: Pallas on the Triton backend, each held equal to its op's plain jnp reference
(the op's module one level up dispatches to it). Every kernel launches through ops/launch.py.
Importing the package memoizes Pallas's Triton lowering per distinct kernel (lowering_memo.py)."""

from deepseek41.ops.gpu import lowering_memo

LOWERING_MEMO = lowering_memo.install()
