"""Pallas kernels on a mesh: each device runs the kernel on its own tokens.

GSPMD cannot partition a `pallas_call`: under jit with sharded operands it gathers them and
every device runs the whole batch. `batch_local` runs the kernel inside a `shard_map` that
splits the leading (batch) dimension over the mesh axes that split the batch (data, fsdp,
expert) and the sequence dimension over `context` (context parallelism), so each device computes
its own queries only; operands that every query needs whole (the compressed KV entries, the
indexer keys) arrive gathered over `context`, weights replicated. The attention kernels split
their heads over `tensor` (head parallelism); the other kernels see replicated operands there.
Without a mesh in context, or when no axis divides the batch or sequence, the kernel runs as it
is. `constrain_tokens` keeps the residual stream split the same way between layers.
"""

from __future__ import annotations

import functools

import jax
from jax.sharding import PartitionSpec as P

BATCH_AXES = ('data', 'fsdp', 'expert')   # sharding.py's mesh axes that the batch rules use
CONTEXT_AXIS = 'context'                  # ... and the one the `length` rule uses
TENSOR_AXIS = 'tensor'                    # ... and the one the `heads` rule uses


def axis_size(mesh, axis: str) -> int:
  return mesh.shape[axis] if axis in mesh.axis_names else 1


def dividing_axes(mesh, axes, dim: int) -> tuple[str, ...]:
  """The axes (in order, size > 1) whose product still divides dim."""
  out, size = [], 1
  for a in axes:
    n = axis_size(mesh, a)
    if n > 1 and dim % (size * n) == 0:
      out.append(a)
      size *= n
  return tuple(out)


def token_split(mesh, b: int, t: int | None):
  """(batch axes, context axis or None) that split a [B, T, ...] activation on this mesh."""
  axes = dividing_axes(mesh, BATCH_AXES, b)
  n_ctx = axis_size(mesh, CONTEXT_AXIS)
  ctx = CONTEXT_AXIS if t is not None and n_ctx > 1 and t % n_ctx == 0 else None
  return axes, ctx


def residual_spec(mesh, b: int, t: int, over_tensor: bool) -> P | None:
  """How the residual stream [B, T, ...] lies between layers: the batch over the batch axes,
  the sequence over `context` and, with `over_tensor` (sequence parallelism), over `tensor`
  too, where the shards divide it. None: nothing beyond the batch split GSPMD propagates."""
  axes, ctx = token_split(mesh, b, t)
  seq = [ctx] if ctx else []
  n_tp = axis_size(mesh, TENSOR_AXIS)
  n_ctx = axis_size(mesh, CONTEXT_AXIS) if ctx else 1
  if over_tensor and n_tp > 1 and t % (n_ctx * n_tp) == 0:
    seq.append(TENSOR_AXIS)
  if not seq:
    return None
  return P(axes or None, tuple(seq) if len(seq) > 1 else seq[0])


def constrain_tokens(x_bt, over_tensor: bool = False):
  """The residual stream [B, T, ...] laid out by `residual_spec`; unchanged without a mesh.

  Split over `tensor` (sequence parallelism, `mesh.sequence_parallel`), the layer outputs that
  block remat keeps for the backward take 1 / mesh.tensor of the memory they take replicated;
  each layer gathers its input over `tensor` (`gather_tensor_split`) where it needs whole rows
  (GSPMD's all-gather, the all-reduce of tensor parallelism becoming a reduce-scatter). The
  residual is gathered before it is split, so the ops that made it keep their usual layout: XLA's
  partitioner (jax 0.11.2) aborts on dots whose operand or result it would split along the
  sequence over context and tensor at once.
  """
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty:
    return x_bt
  x_bt = gather_tensor_split(x_bt, over_tensor)
  spec = residual_spec(mesh, x_bt.shape[0], x_bt.shape[1], over_tensor)
  return x_bt if spec is None else jax.lax.with_sharding_constraint(x_bt, spec)


def gather_tensor_split(x_bt, sequence_parallel: bool = True):
  """A sequence-parallel residual [B, T, ...] whole again over `tensor` (still split over batch
  and context), where a layer or the head reads it; unchanged without sequence parallelism, a
  mesh or a tensor axis."""
  mesh = jax.sharding.get_abstract_mesh()
  if not sequence_parallel or mesh.empty or axis_size(mesh, TENSOR_AXIS) == 1:
    return x_bt
  axes, ctx = token_split(mesh, x_bt.shape[0], x_bt.shape[1])
  return jax.lax.with_sharding_constraint(x_bt, P(axes or None, ctx))


def batch_local(fn, *args, replicated: tuple[int, ...] = (), whole_seq: tuple[int, ...] = (),
                context_kw: str | None = None, split_seq: bool = True,
                heads: dict[int, int] | None = None, out_heads: tuple | None = None,
                tensor_kw: str | None = None, out_whole_seq: tuple[int, ...] = ()):
  """fn(*args) on each device's tokens: array arguments split along their leading (batch) and
  second (sequence) dimensions, except `replicated` positions (weights: whole) and `whole_seq`
  positions (split by batch only: every query of the row needs them); every output split as
  [B, T, ...]. With `context_kw`, fn also gets the context axis name (or None) under that
  keyword, for kernels that exchange a halo with their neighbours. `split_seq=False` keeps every
  argument and output whole along the sequence (ops whose queries need their whole row).

  Head parallelism: `heads` maps argument positions to their head dimension, split over `tensor`
  when the head count divides by it; `out_heads` gives each output's head dimension (None: none);
  with `tensor_kw`, fn gets the tensor axis name (or None), e.g. to average over all heads.
  `out_whole_seq`: output positions (of `out_heads`' length) split by batch only, with no heads
  split: fn has summed them over `context` and `tensor` itself (e.g. the gradient of a
  `whole_seq` argument).

  None arguments pass through. fn may be differentiable (a custom_vjp kernel): the replicated
  arguments' gradients are summed over the batch axes by shard_map's transpose.
  """
  mesh = jax.sharding.get_abstract_mesh()
  heads = heads or {}
  batched = [a for i, a in enumerate(args)
             if a is not None and i not in replicated and i not in whole_seq]
  axes, ctx, tp = (), None, None
  if not mesh.empty and batched:
    lead = batched[0]
    axes, ctx = token_split(mesh, lead.shape[0],
                            lead.shape[1] if lead.ndim > 1 and split_seq else None)
    n_tp = axis_size(mesh, TENSOR_AXIS)
    if heads and n_tp > 1 and all(args[i].shape[d] % n_tp == 0 for i, d in heads.items()):
      tp = TENSOR_AXIS
  if context_kw is not None:
    fn = functools.partial(fn, **{context_kw: ctx})
  if tensor_kw is not None:
    fn = functools.partial(fn, **{tensor_kw: tp})
  if not axes and not ctx and not tp:
    return fn(*args)
  present = [i for i, a in enumerate(args) if a is not None]

  def local(*xs):
    full = [None] * len(args)
    for i, x in zip(present, xs):
      full[i] = x
    return fn(*full)

  def spec(ndim, seq, head_dim):
    entries = [axes or None, ctx if seq else None] + [None] * (ndim - 2)
    if tp and head_dim is not None:
      entries[head_dim] = tp
    return P(*entries[:max(ndim, 1)])
  specs = tuple(P() if i in replicated else
                spec(args[i].ndim, i not in whole_seq, heads.get(i)) for i in present)
  def out_spec(i, head_dim):
    if i in out_whole_seq:
      return P(axes or None)
    return P(axes or None, ctx) if head_dim is None or not tp else spec(head_dim + 1, True,
                                                                        head_dim)
  if out_heads is not None:
    out_specs = tuple(out_spec(i, h) for i, h in enumerate(out_heads))
  else:
    out_specs = P(axes or None, ctx)
  # check_vma=False: pallas_call has no replication rule.
  return jax.shard_map(local, mesh=mesh, in_specs=specs, out_specs=out_specs, check_vma=False)(
      *(args[i] for i in present))
