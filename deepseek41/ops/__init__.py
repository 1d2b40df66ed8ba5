"""Hot ops: each scalable implementation sits beside its plain jnp reference.

    ops/          the op API the model calls, each with its jnp reference and its dispatch to
                  the kernels; contracts.py (the kernels' shape contracts, jax-free);
                  launch.py (where every kernel launches: the interpretation rule, the planner's
                  shapes-only stand-in)
    ops/gpu/      the GPU's Pallas (Triton) kernels
    ops/tpu/      the TPU's Pallas (Mosaic) kernels
    ops/parallel/ the ops on a mesh: kernels per device, the experts and Engram rows across it

Nothing here imports jax: ops.contracts is read where no backend may start (config validation).
"""
