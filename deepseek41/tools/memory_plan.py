"""The per-device memory of one training step on a mesh, and whether it fits the device
(the planner behind `python -m deepseek41.tools.plan`, the CLI in tools/plan.py):
The per-device memory of one training step on a mesh, and whether it fits the device:

  parameters, optimizer state, gradients  exact: every leaf of the abstract train state (the real
                                          optax state of train/optimizer.py) divided by the mesh
                                          axes its fitted PartitionSpec shards it over
                                          (tools/info.bytes_per_device); gradients are
                                          param-shaped, in the param dtype, sharded like params
  activations and temporaries             compiled: one layer of each distinct role
                                          (`layer_signature`) at the per-device batch and
                                          sequence, forward + backward on the CPU backend over
                                          the requested mesh of fake devices, read from
                                          `compiled.memory_analysis()`; the embedding (+ vision)
                                          and the LM head + loss compiled once each

Assembly (`assemble`), train.remat = 'block' (each block a `jax.checkpoint` saving nothing):
every layer's outputs (the residual streams, the single-pass pre-mix and the CSA2 entries it
publishes) stay live from its forward to its backward, so

  backward phase = params + optimizer + gradients + batch + the largest, walking the
                   backward from the top, of: the kept bytes (their shard sizes) still live
                   (every layer's at the head; layers 0..l at layer l's backward; none at the
                   embedding) + that stage: a layer's fwd+bwd temp (its recompute and
                   backward) plus the cotangents it takes and makes, or the head + loss, or the
                   embedding
  optimizer phase = params + optimizer + gradients + the optimizer update's compiled temp
  total = the larger of the two

train.remat = 'block_keep_attention': as 'block', plus the GPU attention kernels' outputs each
layer keeps (`_kernel_output_bytes`, from their shapes).

train.remat = 'none' (and the layers past `train.remat_layers` when it is set): each such
layer keeps what its backward reads instead of its outputs, measured as what a second
application of the layer adds to a compiled forward + backward (so the values XLA recomputes
in the backward's fusions are not counted), and its stage is its temp less those bytes.

The state is donated (as the trainer jits the step) and all gradients are live at once.
Checked against the compiled whole step (`full_step_memory`, `--check_full_step`;
tests/system/test_plan.py): the assembly comes out 7-13% under it (the 4-layer tiny model with block
remat, remat on half its layers and none, and ablation_1b on 8 devices with block remat), about
one parameter-sized buffer the whole program keeps that no single-layer program shows.

The production kernels (Pallas on the GPU, the TPU grouped GEMM) cannot be compiled for the CPU.
For a GPU device kind the config is resolved for the GPU and its own code paths are compiled,
each kernel as its buffers (`ops/launch.py`: an opaque call that holds exactly a kernel's
operands and results, as a GPU kernel does): every Pallas kernel (`launch.pallas_call`, so the
custom VJPs around them keep the GPU's residuals), the routed experts' grouped GEMMs (the
dropless `grouped` backend with its expert-sorted layout and, under expert parallelism, the
allgather exchange's S N gathered tokens and their layout rows) and the vision tower's flash
attention (XLA's dense attention would keep the [P, P] probabilities of every layer). The CPU
compiler fuses less than the GPU's, so on the GPU the plan is an upper bound: at 65,536 tokens
on one H200, 70.7 GiB against 50.5 measured with remat on every layer, 164.0 against 92.1 with
remat on the first six (docs/performance.md 24).
On a TPU device kind (without --topology) the plain-jnp paths of the same math are compiled
(chunked window attention, gathered sparse attention, reference mHC and indexer), and the
routed experts go through the capacity einsum at
the config's capacity factor (ceil(cf N K / E) slots per expert and sequence) in place of the
TPU's grouped GEMM and ragged exchange, whose receive buffer (mesh.expert x N K rows by
default, model.expert_buffer_factor) is not counted: the --topology plan has it. XLA's CPU
buffer assignment is not the GPU's or the TPU's either: the numbers are the CPU compiler's, at
the target's dtypes.

`--topology=v5p:8x8x4` (any TPU slice; the tpu extra): the TPU compiler's plan instead, the
step compiled deviceless for that slice with the TPU's own kernels and buffers
(tools/topology_plan.py; `--per_layer` for the per-role assembly above with the TPU compiler).
"""

from __future__ import annotations

import functools
import math
import re
import time

import jax
import jax.numpy as jnp
import ml_collections
import optax
from absl import logging
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from deepseek41.config import (MeshConfig, RunConfig, layer_roles, remat_label, remats_layer,
                               resolve)
from deepseek41.model.params import RouterBias
from deepseek41.model.shared import Shared
from deepseek41.ops import launch
from deepseek41.ops.parallel.per_device import constrain_tokens, gather_tensor_split, residual_spec
from deepseek41.sharding import batch_sharding, make_mesh
from deepseek41.tools.info import bytes_per_device
from deepseek41.train import feed
from deepseek41.train.optimizer import make_optimizer
from deepseek41.train.objectives import objective_for
from deepseek41.train.state import abstract_state, build_model, model_def, state_shardings
from deepseek41.train.step import head_loss_sums

# Device memory (bytes, as sold: decimal GB) and the backend whose `auto` choices the plan takes.
DEVICE_KINDS = {
    'h200': (141e9, 'gpu'), 'h100': (80e9, 'gpu'), 'v5p': (95e9, 'tpu'), 'v5e': (16e9, 'tpu'),
    'v6e': (32e9, 'tpu'), 'cpu': (0.0, 'cpu'),
}
GIB = 2**30

# The TPU compiler refuses a program that cannot fit the chip, saying by how much: either
# "... memory required for HLO temporaries (208.68G) exceeds available HBM (95.73G)" or
# "Used 120.50G of 95.74G hbm" (XLA's sizes: K/M/G/T are powers of 1024).
_UNITS = {'': 1, 'B': 1, 'K': 2**10, 'M': 2**20, 'G': 2**30, 'T': 2**40}
_TEMP_OVER = re.compile(r'required for HLO temporaries \(([\d.]+)([KMGT]?)\)')
_USED_OVER = re.compile(r'Used ([\d.]+)([KMGT]?) of ([\d.]+)([KMGT]?) hbm')


def over_hbm(error: Exception) -> dict | None:
  """{'temp' or 'used': bytes} from the TPU compiler's out-of-HBM refusal; None for any other
  error."""
  text = str(error)
  if 'RESOURCE_EXHAUSTED' not in text:
    return None
  if m := _USED_OVER.search(text):
    return {'used': float(m.group(1)) * _UNITS[m.group(2)]}
  if m := _TEMP_OVER.search(text):
    return {'temp': float(m.group(1)) * _UNITS[m.group(2)]}
  return None


def refused_memory(error: Exception) -> dict:
  """tools/plan's memory dict for a program the TPU compiler refused as too large for HBM: its
  temporaries as the refusal gives them (arguments and outputs then unknown, counted 0), or
  re-raises the error when it is not that refusal."""
  over = over_hbm(error)
  if over is None:
    raise error
  temp = over.get('temp', over.get('used', 0.0))
  return {'temp': int(temp), 'argument': 0, 'output': 0, 'alias': 0, 'flops': float('nan'),
          'over_hbm': True}


# ---------------------------------------------------------------------------------------------
# The config planned.


def cpu_stand_ins(model: ml_collections.ConfigDict, backend: str) -> list[str]:
  """Make the config compile on the CPU for `backend`: for the GPU its own paths (the kernels
  compile as their buffers within `launch.shapes_only()`), for the TPU the plain-jnp paths of
  the same math; returns what stands in for what, for the report."""
  if backend == 'cpu':
    return []
  notes = []
  if backend == 'gpu':
    # The GPU's own paths, resolved for the GPU; its Pallas kernels, grouped GEMMs and flash
    # attention compile as their operands and results (ops/launch.py).
    notes.append('GPU kernels (Pallas, cuDNN flash attention): as their operands and results')
  else:
    for key, plain in (('attention_impl', 'chunked'), ('sparse_impl', 'gathered'),
                       ('mhc_impl', 'reference'), ('index_impl', 'reference'),
                       ('selected_scores_impl', 'reference'), ('select_impl', 'top_k'),
                       ('vision_attention_impl', 'reference')):
      if model[key] in ('auto', 'fused', 'threshold'):
        notes.append(f'{key}: {model[key]} -> {plain}')
        model[key] = plain
  if backend == 'gpu' and model.moe_backend in ('auto', 'ragged_dot'):
    # The GPU's dropless experts, with their layout and the expert exchange's buffers (the
    # allgather exchange's S*N tokens and S*N*K rows); the kernels compile as their buffers.
    notes.append(f'moe_backend: {model.moe_backend} -> grouped (kernels as their operands '
                 'and results)')
    model.moe_backend = 'grouped'
  elif backend != 'gpu' and model.moe_backend in ('auto', 'grouped', 'grouped_fused',
                                                   'ragged_dot'):
    notes.append(f'moe_backend: {model.moe_backend} -> capacity_einsum (capacity factor '
                 f'{model.capacity_factor})')
    model.moe_backend = 'capacity_einsum'
  if model.compute_dtype == 'auto':
    model.compute_dtype = 'bfloat16'  # the GPU/TPU resolution of `auto`
  return notes


def planned_config(config, mesh_sizes: dict[str, int], *, batch: int | None = None,
                   seq_len: int | None = None, backend: str = 'cpu',
                   compile_for: str = 'cpu') -> tuple[RunConfig, list]:
  """The config on this mesh at this batch and length, compile-able on the CPU for `backend`
  (compile_for='tpu' or 'gpu': for that target's compiler, deviceless, the auto choices its
  own, nothing stood in: tools/topology_plan.py)."""
  config = config.copy_and_resolve_references()
  for axis in MeshConfig.AXES:
    config.mesh[axis] = mesh_sizes.get(axis, 1)
  if batch is not None:
    config.train.batch_size = batch
  if seq_len is not None:
    config.data.seq_len = seq_len
  if compile_for in ('tpu', 'gpu'):
    return resolve(config, num_devices=math.prod(mesh_sizes.values()), backend=compile_for), []
  notes = cpu_stand_ins(config.model, backend)
  resolve_for = 'gpu' if backend == 'gpu' else 'cpu'   # the GPU's choices, compiled as above
  return resolve(config, num_devices=math.prod(mesh_sizes.values()), backend=resolve_for), notes


# ---------------------------------------------------------------------------------------------
# Exact parts.


def state_bytes(cfg: RunConfig) -> dict[str, float]:
  """params / optimizer / router_bias from the abstract state; gradients = params (same shapes,
  dtype and specs: jax.grad of the param tree, accumulated in a param-shaped buffer)."""
  sizes = {a: getattr(cfg.mesh, a) for a in MeshConfig.AXES}
  out = bytes_per_device(abstract_state(cfg, make_optimizer(cfg.train)), cfg.mesh.rules, sizes)
  return {**out, 'gradients': out['params']}


# ---------------------------------------------------------------------------------------------
# Compiled parts.


def abstract_batch(cfg: RunConfig) -> dict[str, jax.ShapeDtypeStruct]:
  """A microbatch's global shapes (deepseek41/batch.py)."""
  return feed.abstract_batch(cfg, cfg.train.batch_size // cfg.train.grad_accum_steps)


def layer_signature(role) -> tuple:
  """What makes two layers' programs the same: everything of the role but its layer ids."""
  return (role.ratio, role.mode,
          role.kv_source == role.layer, role.index_source == role.layer,
          role.publishes_candidates, role.uses_candidates, role.engram)


def role_table(cfg: RunConfig) -> dict[tuple, list[int]]:
  """signature (+ whether the layer runs under remat) -> the layers that have it (the first
  is the one compiled)."""
  table: dict[tuple, list[int]] = {}
  t = cfg.train
  for role in layer_roles(cfg.model):
    key = layer_signature(role) + (remats_layer(t.remat, t.remat_layers, role.layer),)
    table.setdefault(key, []).append(role.layer)
  return table


def _batch_spec(mesh, rules, x, b: int, t: int, over_tensor: bool = False):
  """Arrays with the batch leading are sharded like the batch, and [B, T, ...] ones as the
  residual between layers (`constrain_tokens`: the sequence over context and, with sequence
  parallelism, tensor); anything else is replicated."""
  if x.ndim >= 2 and x.shape[:2] == (b, t):
    spec = residual_spec(mesh, b, t, over_tensor)
    if spec is not None:
      return NamedSharding(mesh, spec)
  if x.ndim and x.shape[0] == b:
    return batch_sharding(mesh, rules, x.ndim)
  return NamedSharding(mesh, P())


def _memory(compiled) -> dict[str, int]:
  m = compiled.memory_analysis()
  cost = compiled.cost_analysis()
  cost = cost[0] if isinstance(cost, (list, tuple)) else cost
  # NaN where the compiler counts none (the GPU compiler, deviceless): not zero work.
  return {'temp': int(m.temp_size_in_bytes), 'argument': int(m.argument_size_in_bytes),
          'output': int(m.output_size_in_bytes), 'alias': int(m.alias_size_in_bytes),
          'flops': float(cost.get('flops', 0.0)) if cost else float('nan')}


def program_memory(compiled) -> dict:
  """`_memory` of a whole program, with its peak: arguments, temporaries and outputs, less the
  outputs that alias (donated) arguments."""
  mem = _memory(compiled)
  mem['peak'] = mem['argument'] + mem['temp'] + mem['output'] - mem['alias']
  return mem


def _is_float(x) -> bool:
  return jnp.issubdtype(x.dtype, jnp.floating)


def _split_float(tree):
  """(float leaves, int leaves, rebuild(float, int) -> tree)."""
  leaves, treedef = jax.tree.flatten(tree)
  is_f = [_is_float(x) for x in leaves]

  def rebuild(fl, il):
    fi, ii = iter(fl), iter(il)
    return jax.tree.unflatten(treedef, [next(fi) if f else next(ii) for f in is_f])
  return [x for x, f in zip(leaves, is_f) if f], [x for x, f in zip(leaves, is_f) if not f], \
      rebuild


def _dot(outs, cts):
  """A scalar whose gradient sends `cts` back through `outs` (the real step's cotangents)."""
  return sum(jnp.sum(o.astype(jnp.float32) * c.astype(jnp.float32)) for o, c in zip(outs, cts))


# LLVM's optimisation of the CPU code is skipped: buffer assignment (all memory_analysis reads)
# runs on the optimised HLO before it, and the 4-layer test model's step compiles in 41 s
# instead of 88 s with the same memory numbers to the byte.
FAST_CPU_COMPILE = {'xla_backend_optimization_level': 0, 'xla_llvm_disable_expensive_passes': True}


def compile_options(shardings):
  """FAST_CPU_COMPILE on the CPU; the TPU compiler (tools/topology_plan.py) takes its defaults."""
  named = [s for s in jax.tree.leaves(shardings) if isinstance(s, NamedSharding)]
  cpu = not named or named[0].mesh.devices.flat[0].platform == 'cpu'
  return FAST_CPU_COMPILE if cpu else None


def _compile(fn, args, shardings, out_shardings=None, name=''):
  t0 = time.perf_counter()
  jitted = jax.jit(fn, in_shardings=shardings, out_shardings=out_shardings)
  try:
    mem = _memory(jitted.lower(*args).compile(compile_options(shardings)))
  except jax.errors.JaxRuntimeError as e:  # the TPU compiler refuses what exceeds HBM
    mem = refused_memory(e)
  seconds = time.perf_counter() - t0
  logging.info('plan: compiled %s in %.1f s', name or fn.__name__, seconds)
  return mem, seconds


def lowered_train_step(cfg: RunConfig, devices=None):
  """(The whole train step lowered as the trainer jits it (state donated), its compile
  options) on the config's mesh of `devices` (fake CPU devices, or a TPU topology's for
  tools/topology_plan.py)."""
  mesh = make_mesh(cfg.mesh, devices)
  tx = make_optimizer(cfg.train)
  md = model_def(cfg, tx)
  abstract = abstract_state(cfg, tx)
  shardings = state_shardings(abstract, mesh, cfg.mesh.rules)
  batch = abstract_batch(cfg)
  bsh = jax.tree.map(lambda x: batch_sharding(mesh, cfg.mesh.rules, x.ndim), batch)
  with jax.set_mesh(mesh):
    step = jax.jit(objective_for(cfg).make_train_step(md), in_shardings=(shardings, bsh),
                   out_shardings=(shardings, NamedSharding(mesh, P())), donate_argnums=(0,))
    return step.lower(abstract, batch), compile_options(shardings)


def full_step_memory(cfg: RunConfig, devices=None) -> dict:
  """memory_analysis() of the whole train step, jitted as the trainer does (state donated):
  the check of the per-layer assembly, affordable for small models only."""
  t0 = time.perf_counter()
  lowered, options = lowered_train_step(cfg, devices)
  mem = program_memory(lowered.compile(options))
  mem['compile_seconds'] = time.perf_counter() - t0
  return mem


def _sharded_bytes(tree, shardings) -> int:
  """Bytes one device holds of `tree` under `shardings` (the largest shard)."""
  leaves = [x.get_value() if isinstance(x, nnx.Variable) else x for x in
            jax.tree.leaves(tree, is_leaf=lambda v: isinstance(v, nnx.Variable))]
  specs = [s.get_value() if isinstance(s, nnx.Variable) else s for s in
           jax.tree.leaves(shardings, is_leaf=lambda v: isinstance(v, nnx.Variable))]
  return int(sum(math.prod(s.shard_shape(x.shape)) * x.dtype.itemsize
                 for x, s in zip(leaves, specs)))


def compile_programs(cfg: RunConfig, devices=None, layers=None) -> dict:
  """Compile, on the config's mesh, the forward + backward of one layer of each role, of the
  embedding (+ vision) and of the LM head + loss, and the optimizer update; return their
  memory_analysis() per device and the bytes that live between them (`assemble` adds it up).
  `layers`: only the roles of these layers, nothing else (a question about one layer's
  program, not a plan)."""
  t_start = time.perf_counter()
  mesh = make_mesh(cfg.mesh, devices)
  rules = cfg.mesh.rules
  model = nnx.eval_shape(lambda: build_model(cfg))
  graphdef, params, biases = nnx.split(model, nnx.Param, RouterBias)
  batch = abstract_batch(cfg)
  b, t = batch['tokens'].shape

  def spec(tree):
    return jax.tree.map(lambda x: _batch_spec(mesh, rules, x, b, t,
                                              cfg.mesh.sequence_parallel), tree)

  # One abstract pass learns every layer's inputs (the residual, pre and CSA2's `shared`).
  def trace(params, biases, batch):
    mdl = nnx.merge(graphdef, params, biases)
    x, pre = mdl.residual_input(batch)
    batch = mdl.with_engram_rows(batch)
    ins, shared = [], Shared()
    for block in mdl.blocks:
      ins.append((x, pre, shared))
      x, pre, _, shared = block(x, pre, batch, shared)
    return ins, (x, pre), batch
  layer_in, top, full_batch = jax.eval_shape(trace, params, biases, batch)

  out = {'roles': {}}
  with jax.set_mesh(mesh):
    for same in role_table(cfg).values():
      if layers is not None and not set(same) & set(layers):
        continue
      l = same[0]
      out['roles'][str(l)] = {'layers': same, **_compile_layer(
          cfg, mesh, model.blocks[l], layer_in[l], full_batch, spec)}
    if layers is None:
      out['head'] = _compile_head(cfg, mesh, model, top, batch, spec)
      out['embed'] = _compile_embed(cfg, mesh, model, batch, spec)
      out['optimizer'] = _compile_optimizer(cfg, mesh, params)
  out['batch_bytes'] = _sharded_bytes(batch, spec(batch))
  out['compile_seconds'] = time.perf_counter() - t_start
  out['devices'] = mesh.size
  out['mesh'] = dict(mesh.shape)
  return out


def _kernel_output_bytes(m, role, batch, spec) -> int:
  """What train.remat=block_keep_attention keeps of a layer besides its outputs: the GPU
  attention kernels' outputs (model/transformer.py `_rematerialized`), counted from their
  shapes, as the CPU stand-ins name none: the window partial, and at CSA2 layers the sparse
  partial, at index sources also the slot mass and the indexer's selected scores. With
  `model.merged_backward` and a fused kernel, the layer's merged softmax (one output and
  log-sum-exp) in place of the partials (ops/softmax_merge.py)."""
  b, t = batch['tokens'].shape
  dt = jnp.bfloat16 if m.compute_dtype == 'bfloat16' else jnp.float32
  partial = [jax.ShapeDtypeStruct((b, t, m.num_heads, m.head_dim), dt),
             jax.ShapeDtypeStruct((b, t, m.num_heads), jnp.float32)]
  csa2 = m.csa2 and role.ratio
  kept = list(partial)
  merged = m.merged_backward and (m.attention_impl == 'fused' or
                                  (csa2 and m.sparse_impl == 'fused'))
  if csa2 and not merged:
    kept += partial
  if csa2 and role.index_source == role.layer:
    kept += [jax.ShapeDtypeStruct((b, t, m.index_topk), jnp.float32)] * 2
  return _sharded_bytes(kept, spec(kept))


def _compile_layer(cfg, mesh, block, inputs, batch, spec) -> dict:
  """One block, forward + backward: the recompute and backward of one layer under block remat,
  with the cotangents of its outputs as arguments (what the layers above send back)."""
  rules = cfg.mesh.rules
  gd, p, rb = nnx.split(block, nnx.Param, RouterBias)
  x, pre, shared = inputs
  s_float, s_int, rebuild = _split_float(shared)
  p_sh, rb_sh = state_shardings(p, mesh, rules), state_shardings(rb, mesh, rules)

  sp = cfg.mesh.sequence_parallel

  def forward(p, rb, x, pre, s_float, s_int, batch):
    """(x, pre, what this layer adds to `shared`: entries, selections, indexer totals), aux.
    The residual's layouts at the layer's ends are Transformer.run_blocks'."""
    x2, pre2, aux, shared2 = nnx.merge(gd, p, rb)(gather_tensor_split(x, sp), pre, batch,
                                                  rebuild(s_float, s_int))
    x2 = constrain_tokens(x2, sp)
    return (x2, pre2, shared2.added_since(shared)), aux

  args = (p, rb, x, pre, s_float, s_int, batch)
  shardings = (p_sh, rb_sh, spec(x), spec(pre), spec(s_float), spec(s_int), spec(batch))
  outs = jax.eval_shape(lambda *a: forward(*a)[0], *args)
  o_float, _, _ = _split_float(outs)

  def fwd_bwd(p, rb, x, pre, s_float, s_int, batch, cts, applications=1):
    """Gradients through `applications` chained copies of the layer (the same parameters)."""
    def objective(p, x, pre, s_float):
      kept, balance = (x, pre, None), 0.0
      for _ in range(applications):
        kept, aux = forward(p, rb, kept[0], kept[1], s_float, s_int, batch)
        balance = balance + aux['balance']
      return _dot(_split_float(kept)[0], cts) + balance
    return jax.grad(objective, argnums=(0, 1, 2, 3))(p, x, pre, s_float)

  in_ct_sh = (spec(x), spec(pre), spec(s_float))
  compile_fwd_bwd = functools.partial(
      _compile, args=args + (o_float,), shardings=shardings + (spec(o_float),),
      out_shardings=(p_sh,) + in_ct_sh)
  mem, seconds = compile_fwd_bwd(fwd_bwd, name=f'layer {block.layer} forward + backward')
  # An index source's sinks are zeros nothing reads in the forward (model/shared.py `Shared`):
  # not kept. Their cotangents, the readers' coefficients, are counted where they are cotangents.
  sinks = outs[2].sinks
  result = {
      'fwd_bwd': mem, 'compile_seconds': seconds,
      # Under block remat a layer keeps exactly its outputs until its backward.
      'kept_bytes': _sharded_bytes(outs, spec(outs)) - _sharded_bytes(sinks, spec(sinks)),
      'cotangent_in_bytes': _sharded_bytes(o_float, spec(o_float)),
      'cotangent_out_bytes': _sharded_bytes((x, pre, s_float), in_ct_sh),
      'grad_bytes': _sharded_bytes(p, p_sh),
  }
  rematted = remats_layer(cfg.train.remat, cfg.train.remat_layers, block.layer)
  if rematted and cfg.train.remat == 'block_keep_attention':
    result['kept_bytes'] += _kernel_output_bytes(cfg.model, block.attn.role, batch, spec)
  if not rematted:
    # The layer keeps what its backward reads instead. Which of those values XLA stores, and
    # which it recomputes inside the backward's fusions (an fp32 upcast of a bf16 input, say),
    # shows only in a program that holds more than one layer: the kept bytes are what a second
    # application of the layer adds to the temp. (The vjp's residuals compiled as outputs
    # overcounted by a third on the test model and 2x for the GPU paths.)
    mem2, t2 = compile_fwd_bwd(functools.partial(fwd_bwd, applications=2),
                               name=f'layer {block.layer} twice, forward + backward')
    result['kept_bytes'] = max(mem2['temp'] - mem['temp'], result['kept_bytes'])
    result['compile_seconds'] += t2
    # Its one-layer temp holds those values too (less its input, an argument there), and the
    # assembly counts them with the kept bytes: the stage is the backward's own transient.
    result['stage_temp'] = max(
        mem['temp'] - (result['kept_bytes'] - result['cotangent_out_bytes']), 0)
  return result


def _compile_optimizer(cfg, mesh, params) -> dict:
  t0 = time.perf_counter()
  compiled = compiled_optimizer_update(cfg, mesh, params)
  return {'update': _memory(compiled), 'compile_seconds': time.perf_counter() - t0}


def compiled_optimizer_update(cfg: RunConfig, mesh, params):
  """The optimizer's update (train/optimizer.py: AdamW or muon_hybrid) compiled on the sharded
  parameters, state donated as the trainer does."""
  tx = make_optimizer(cfg.train)
  opt = jax.eval_shape(tx.init, params)
  rules = cfg.mesh.rules
  p_sh = state_shardings(params, mesh, rules)
  o_sh = state_shardings(opt, mesh, rules)

  def update(params, opt, grads):
    updates, opt = tx.update(grads, opt, params)
    return optax.apply_updates(params, updates), opt

  return jax.jit(update, in_shardings=(p_sh, o_sh, p_sh), out_shardings=(p_sh, o_sh),
                 donate_argnums=(0, 1)).lower(params, opt, params).compile(compile_options(p_sh))


class _View:
  """The Transformer methods around the blocks, on just the parameters they read (the compiled
  programs then take only those as arguments)."""
  from deepseek41.model.transformer import Transformer as _T
  logits = _T.logits
  final_hidden = _T.final_hidden
  head_weight = _T.head_weight
  embed_inputs = _T.embed_inputs
  residual_input = _T.residual_input
  with_engram_rows = _T.with_engram_rows
  _engram_addresses = _T._engram_addresses

  def __init__(self, cfg, parts: dict, sequence_parallel: bool = True):
    self.cfg = cfg
    self.vision = None
    self.sequence_parallel = sequence_parallel
    self.__dict__.update(parts)


def _submodule(model, name):
  """(graphdef, params) of a submodule, or of a bare parameter (graphdef None)."""
  sub = getattr(model, name)
  if isinstance(sub, nnx.Variable):
    return None, sub
  return nnx.graphdef(sub), nnx.state(sub, nnx.Param)


def _merged(defs, state):
  return {k: state[k] if defs[k] is None else nnx.merge(defs[k], state[k]) for k in defs}


def _compile_head(cfg, mesh, model, top, batch, spec) -> dict:
  """Final read + norm + LM head + cross-entropy, forward + backward, from the last residual:
  the whole logits, or with model.head_chunk the fused op's chunks (train/step.py's path)."""
  rules = cfg.mesh.rules
  x, pre = top
  defs, part = {}, {}
  # V4's multi-pass mHC reads the streams through a learned head (model/transformer.py).
  multi_pass = cfg.model.residual == 'mhc_multi_pass'
  for name in ('head', 'final_norm') + (('hc_head',) if multi_pass else ()):
    defs[name], part[name] = _submodule(model, name)

  def loss(part, x, pre, targets, mask):
    view = _View(cfg.model, _merged(defs, part), cfg.mesh.sequence_parallel)
    out = view.final_hidden(x, pre) if cfg.model.head_chunk else view.logits(x, pre)
    return head_loss_sums(view, out, {'targets': targets, 'loss_mask': mask})[0]

  def fwd_bwd(part, x, pre, targets, mask):
    return jax.grad(loss, argnums=(0, 1, 2))(part, x, pre, targets, mask)

  part_sh = state_shardings(part, mesh, rules)
  args = (part, x, pre, batch['targets'], batch['loss_mask'])
  shardings = (part_sh, spec(x), spec(pre), spec(batch['targets']), spec(batch['loss_mask']))
  mem, t = _compile(fwd_bwd, args, shardings, (part_sh, spec(x), spec(pre)), name='head + loss')
  return {'fwd_bwd': mem, 'compile_seconds': t, 'grad_bytes': _sharded_bytes(part, part_sh),
          'cotangent_out_bytes': _sharded_bytes((x, pre), (spec(x), spec(pre)))}


def _compile_embed(cfg, mesh, model, batch, spec) -> dict:
  """Embedding (+ vision encoder and aligner) and the Engram row ids, forward + backward, to the
  residual entering layer 0."""
  rules = cfg.mesh.rules
  defs, part = {}, {}
  for name in ('embed',) + (('vision',) if cfg.model.vision else ()):
    defs[name], part[name] = _submodule(model, name)

  def inputs(part, batch):
    view = _View(cfg.model, _merged(defs, part))
    x, _ = view.residual_input(batch)
    return x, view.with_engram_rows(batch).get('engram_row_ids')

  x0, _ = jax.eval_shape(inputs, part, batch)

  def fwd_bwd(part, batch, ct):
    def objective(part):
      x, rows = inputs(part, batch)
      return _dot([x], [ct]), rows
    return jax.grad(objective, has_aux=True)(part)

  part_sh = state_shardings(part, mesh, rules)
  mem, t = _compile(fwd_bwd, (part, batch, x0), (part_sh, spec(batch), spec(x0)), name='embed')
  return {'fwd_bwd': mem, 'compile_seconds': t, 'grad_bytes': _sharded_bytes(part, part_sh),
          'cotangent_in_bytes': _sharded_bytes(x0, spec(x0))}


# ---------------------------------------------------------------------------------------------
# Assembly and report.


def assemble(state: dict[str, float], programs: dict) -> dict:
  """Per-device bytes of one step from the exact state and the compiled programs.

  Backward phase, walked from the top as the step runs it: at the head, every layer's kept
  bytes are live; at layer l's backward, those of layers 0..l (the layers above have freed
  theirs), plus that stage's transient: one program's temp plus the cotangents it takes and
  makes (its parameter gradients are in `gradients` already); at the embedding, none. The
  largest of these plus the batch are the activations. Optimizer phase: the update's temp (the
  activations are gone by then). Both phases hold params + optimizer + gradients.
  """
  roles = programs['roles']
  order = sorted((layer, r) for r in roles.values() for layer in r['layers'])
  kept_all = sum(r['kept_bytes'] for _, r in order)
  stages, live = {}, {}
  below = 0
  for layer, r in order:
    below += r['kept_bytes']
    stages[f'layer {layer}'] = (r.get('stage_temp', r['fwd_bwd']['temp']) +
                                r['cotangent_in_bytes'] + r['cotangent_out_bytes'])
    live[f'layer {layer}'] = below
  stages['head'] = programs['head']['fwd_bwd']['temp'] + programs['head']['cotangent_out_bytes']
  live['head'] = kept_all
  stages['embed'] = programs['embed']['fwd_bwd']['temp'] + \
      programs['embed']['cotangent_in_bytes']
  live['embed'] = 0
  peak = max(stages, key=lambda k: live[k] + stages[k])
  activations = programs['batch_bytes'] + live[peak] + stages[peak]
  update_temp = programs['optimizer']['update']['temp']
  exact = state['params'] + state['optimizer'] + state.get('router_bias', 0) + state['gradients']
  return {**state, 'activations': activations, 'kept_by_layers': live[peak],
          'kept_all_layers': kept_all, 'peak_stage': peak, 'peak_stage_bytes': stages[peak],
          'stages': stages, 'optimizer_update_temp': update_temp,
          'total': exact + max(activations, update_temp)}


def plan(config, mesh_sizes: dict[str, int], *, batch: int | None = None,
         seq_len: int | None = None, device_kind: str = 'h200', hbm_bytes: float | None = None,
         devices=None, check_full_step: bool = False) -> dict:
  """The plan of one config on one mesh: exact state, compiled activations, fit; with
  `check_full_step`, also the compiled whole step's memory (small models)."""
  hbm, backend = DEVICE_KINDS[device_kind]
  hbm = hbm if hbm_bytes is None else hbm_bytes
  cfg, notes = planned_config(config, mesh_sizes, batch=batch, seq_len=seq_len, backend=backend)
  state = state_bytes(cfg)
  with launch.shapes_only():  # compiled, never run
    programs = compile_programs(cfg, devices)
    full_step = full_step_memory(cfg, devices) if check_full_step else None
  per_device = assemble(state, programs)
  n = math.prod(mesh_sizes.values())
  batch_shards = math.prod(getattr(cfg.mesh, a) for name, axes in cfg.mesh.rules
                           if name == 'batch' for a in axes)
  return {
      'mesh': mesh_sizes, 'devices': n, 'device_kind': device_kind, 'hbm_bytes': hbm,
      'batch': cfg.train.batch_size, 'seq_len': cfg.data.seq_len,
      'per_device_batch': cfg.train.batch_size // cfg.train.grad_accum_steps // batch_shards,
      'remat': remat_label(cfg.train), 'compute_dtype': cfg.model.compute_dtype,
      'param_dtype': cfg.model.param_dtype, 'moe_backend': cfg.model.moe_backend,
      'stand_ins': notes, 'per_device': per_device,
      'fits': bool(hbm and per_device['total'] <= hbm),
      'headroom_bytes': hbm - per_device['total'] if hbm else None,
      'compile_seconds': programs['compile_seconds'], 'programs': programs,
      'full_step': full_step,
  }


def report(p: dict) -> str:
  d = p['per_device']
  g = lambda x: f'{x / GIB:9.2f} GiB'  # noqa: E731
  mesh = ','.join(f'{k}={v}' for k, v in p['mesh'].items())
  roles = p['programs']['roles']
  lines = [
      f"mesh {mesh} ({p['devices']} x {p['device_kind']}, {p['hbm_bytes'] / 1e9:g} GB); batch "
      f"{p['batch']} x {p['seq_len']} tokens ({p['per_device_batch']} sequence(s) per device); "
      f"remat {p['remat']}; compute {p['compute_dtype']}, params {p['param_dtype']}",
      f"  parameters   {g(d['params'])}   exact (abstract state, fitted specs)",
      f"  optimizer    {g(d['optimizer'])}   exact (the optimizer's moments + counts)",
      f"  gradients    {g(d['gradients'])}   exact (param-shaped, param dtype)",
      f"  router bias  {g(d.get('router_bias', 0))}",
      f"  activations  {g(d['activations'])}   compiled: {len(roles)} role program(s) for "
      f"{sum(len(r['layers']) for r in roles.values())} layers; kept by the layers below "
      f"it {d['kept_by_layers'] / GIB:.2f} GiB + peak stage ({d['peak_stage']}) "
      f"{d['peak_stage_bytes'] / GIB:.2f} GiB",
      f"  total        {g(d['total'])}   of {p['hbm_bytes'] / GIB:.2f} GiB: " +
      (('fits, headroom ' if p['fits'] else 'DOES NOT FIT, short by ') +
       f"{abs(p['headroom_bytes']) / GIB:.2f} GiB" if p['hbm_bytes'] else 'no HBM given'),
      f"  compiled in {p['compile_seconds']:.0f} s on {p['programs']['devices']} fake CPU "
      f"devices" + (f"; CPU stand-ins: {'; '.join(p['stand_ins'])}" if p['stand_ins'] else ''),
  ]
  if p.get('full_step'):
    f = p['full_step']
    lines.append(f"  full step compiled: {g(f['peak'])} (argument {f['argument'] / GIB:.2f} + temp "
                 f"{f['temp'] / GIB:.2f} + output {f['output'] / GIB:.2f} - aliased "
                 f"{f['alias'] / GIB:.2f} GiB) in {f['compile_seconds']:.0f} s; plan "
                 f"{d['total'] / f['peak'] - 1:+.1%}")
  return '\n'.join(lines)


def candidate_meshes(devices: int, cfg_model) -> list[dict[str, int]]:
  """fsdp x expert x tensor factorisations of the device count with data = 1: expert divides the
  routed experts, tensor divides the heads (and is at most 8: one host's NVLink domain)."""
  out = []
  for expert in range(1, devices + 1):
    if devices % expert or cfg_model.n_routed_experts % expert:
      continue
    for tensor in (1, 2, 4, 8):
      if (devices // expert) % tensor or cfg_model.num_heads % tensor:
        continue
      out.append({'fsdp': devices // expert // tensor, 'expert': expert, 'tensor': tensor})
  return out
