"""Which weights a program reads only in the compute dtype: a walk over the program's jaxpr.

A decode step reads every weight once per token, and at batch 1 that read is its whole cost. A
weight stored in fp32 whose every use is a cast to bf16 costs XLA a 4-byte read each token (the
convert fused into its consumer) where a 2-byte read would give the same products. Casting such
a weight once, when generation loads the model, changes no value anywhere: after the cast the
program's own cast is a no-op, and reshapes, transposes and slices commute with a cast
elementwise.

`read_only_as` decides this from the jaxpr, not from names, so that it stays exact as the model's
code changes: a weight is cast only if the traced programs read it, and each read, followed
through layout-only ops and into nested calls (jit, remat, custom_vjp/jvp, shard_map, scan and
while bodies, cond branches), ends in a cast to exactly that dtype. Anything else (a dot in fp32,
a Pallas kernel's operand, a loop carry, a program output) keeps the weight as it is.
"""

from __future__ import annotations

import jax
import numpy as np

# Ops that move or select elements without computing on them: a cast after them equals the same
# op after the cast.
_LAYOUT_OPS = frozenset({'reshape', 'transpose', 'squeeze', 'expand_dims', 'broadcast_in_dim',
                         'slice', 'rev', 'copy', 'copy_p', 'reshard', 'sharding_constraint',
                         'name'})

UNREAD, CAST_ONLY, OTHER = 'unread', 'cast_only', 'other'


def _open(j):
  return getattr(j, 'jaxpr', j)  # a ClosedJaxpr's Jaxpr, or the Jaxpr itself


def _inner_targets(eqn, i: int):
  """The (jaxpr, invar) pairs that operand i of a nested-call eqn flows into; None where the
  flow is not a plain read (a loop carry, an unknown primitive)."""
  name, p = eqn.primitive.name, eqn.params
  if name == 'scan':
    body = _open(p['jaxpr'])
    if 'num_consts' in p:
      carry = p['num_consts'] <= i < p['num_consts'] + p['num_carry']
    else:  # jax 0.11: the operands as a packed (consts, carry, xs) tree
      carry = i in p['ft_in'].update(list(range(len(eqn.invars)))).unpack()[1]
    return None if carry else [(body, body.invars[i])]
  if name == 'while':
    nc, nb = p['cond_nconsts'], p['body_nconsts']
    if i < nc:
      cond = _open(p['cond_jaxpr'])
      return [(cond, cond.invars[i])]
    if i < nc + nb:
      body = _open(p['body_jaxpr'])
      return [(body, body.invars[i - nc])]
    return None
  if name == 'cond':
    if i == 0:
      return None
    return [(_open(b), _open(b).invars[i - 1]) for b in p['branches']]
  if name == 'pallas_call':
    return None
  # Call-like primitives (jit, remat, custom_jvp/vjp's forward, shard_map, closed_call): the
  # one sub-jaxpr whose inputs are the operands, in order.
  subs = [_open(v) for v in p.values()
          if hasattr(_open(v), 'eqns') and len(_open(v).invars) == len(eqn.invars)]
  if len(subs) != 1:
    return None
  return [(subs[0], subs[0].invars[i])]


def _merge(verdicts) -> str:
  """OTHER if any is (without looking further), else CAST_ONLY if any is, else UNREAD."""
  state = UNREAD
  for got in verdicts:
    if got == OTHER:
      return OTHER
    if got == CAST_ONLY:
      state = CAST_ONLY
  return state


class _Walk:
  def __init__(self, dtype):
    self.dtype = np.dtype(dtype)
    self.memo = {}
    self.uses = {}  # id(jaxpr) -> {var: [(eqn, operand index)]}

  def reads(self, jaxpr, var) -> str:
    """UNREAD, CAST_ONLY or OTHER for `var` in `jaxpr`."""
    key = (id(jaxpr), var)
    if key not in self.memo:
      self.memo[key] = self._reads(jaxpr, var)
    return self.memo[key]

  def _uses(self, jaxpr) -> dict:
    if id(jaxpr) not in self.uses:
      uses = {}
      for eqn in jaxpr.eqns:
        for i, operand in enumerate(eqn.invars):
          if not hasattr(operand, 'val'):  # a Var, not a Literal
            uses.setdefault(operand, []).append((eqn, i))
      for v in jaxpr.outvars:
        if not hasattr(v, 'val'):
          uses.setdefault(v, []).append((None, -1))
      self.uses[id(jaxpr)] = uses
    return self.uses[id(jaxpr)]

  def _reads(self, jaxpr, var) -> str:
    return _merge(OTHER if eqn is None else self._use(jaxpr, eqn, i)  # None: an output
                  for eqn, i in self._uses(jaxpr).get(var, ()))

  def _use(self, jaxpr, eqn, i: int) -> str:
    name = eqn.primitive.name
    if name == 'convert_element_type':
      return CAST_ONLY if np.dtype(eqn.params['new_dtype']) == self.dtype else OTHER
    if name in _LAYOUT_OPS or (name == 'dynamic_slice' and i == 0):
      return self._combine([(jaxpr, out) for out in eqn.outvars])
    targets = _inner_targets(eqn, i)
    if targets is None:
      return OTHER
    return self._combine(targets)

  def _combine(self, targets) -> str:
    return _merge(self.reads(jaxpr, var) for jaxpr, var in targets)


def read_only_as(fn, leaves: list, args: tuple, dtype) -> list[str]:
  """For each of `leaves` (arrays or ShapeDtypeStructs), how `fn(leaves, *args)` reads it:
  UNREAD, CAST_ONLY (every read is a cast to `dtype`) or OTHER."""
  closed = jax.make_jaxpr(fn)(leaves, *args)
  walk = _Walk(dtype)
  n = len(jax.tree.leaves(leaves))
  return [walk.reads(closed.jaxpr, v) for v in closed.jaxpr.invars[:n]]


def wider_float(x, dtype) -> bool:
  """Whether the array (or ShapeDtypeStruct) x holds floats wider than `dtype`."""
  return bool(np.issubdtype(x.dtype, np.floating)
              and np.dtype(x.dtype).itemsize > np.dtype(dtype).itemsize)


def read_only_as_mask(state, probes, dtype):
  """A pytree of bools over `state` (a pytree of arrays or ShapeDtypeStructs): True at each
  floating leaf wider than `dtype` that every probe reads only as a cast to `dtype`, and at
  least one reads. `probes`: functions of the state, traced abstractly (nothing runs)."""
  dt = np.dtype(dtype)
  leaves, treedef = jax.tree.flatten(state)
  verdicts = [read_only_as(lambda ls, probe=probe: probe(jax.tree.unflatten(treedef, ls)),
                           leaves, (), dt) for probe in probes]
  mask = [wider_float(x, dt) and _merge(v[i] for v in verdicts) == CAST_ONLY
          for i, x in enumerate(leaves)]
  return jax.tree.unflatten(treedef, mask)


def cast_where(state, mask, dtype):
  """`state` with the leaves where `mask` is True cast to `dtype` (abstract leaves too)."""
  def cast(x, m):
    if not m:
      return x
    if isinstance(x, jax.ShapeDtypeStruct):
      return jax.ShapeDtypeStruct(x.shape, dtype, sharding=x.sharding)
    return x.astype(dtype)
  return jax.tree.map(cast, state, mask)
