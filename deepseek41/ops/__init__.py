"""Hot ops: each scalable implementation sits beside its plain jnp reference."""
