"""One update of a config from its initialisation, and which parameters it leaves non-finite
or moves most: a first look when a run stops with a non-finite loss at its second step. For a
token table (`TokenTable`: the Sinkhorn-balanced update of muon_hybrid) left non-finite, its
gradient and each of the balance's passes are traced on the device: where the first
non-finite value appears, and the smallest and largest norms each pass divides by.

    python benchmarks/check_update_finite.py --config=configs/ablation_1b.py \
        --config.train.optimizer=muon_hybrid --config.data.seq_len=4096 \
        --config.train.batch_size=8 --config.train.remat=none
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from absl import app, flags
from ml_collections import config_flags

from deepseek41.config import resolve
from deepseek41.model.params import TokenTable, token_axis_of
from deepseek41.sharding import batch_sharding, make_mesh
from deepseek41.train import state as state_lib
from deepseek41.train.objectives import objective_for
from deepseek41.train.optimizer import make_optimizer
from deepseek41.train.state import named_leaves
from deepseek41.train.muon import sinkhorn_balance
from deepseek41.train.step import accumulate_gradients

_CONFIG = config_flags.DEFINE_config_file('config', None, 'A get_config() file.')
_TRACE_ALL = flags.DEFINE_bool('trace_all_tables', False, 'Trace every token table\'s balance, '
                               'not only those left non-finite.')


def synthetic_batch(cfg, seed: int = 0) -> dict[str, np.ndarray]:
  rng = np.random.default_rng(seed)
  b, t = cfg.train.batch_size, cfg.data.seq_len
  tokens = rng.integers(3, cfg.model.vocab_size, (b, t + 1)).astype(np.int32)
  return {'tokens': tokens[:, :-1], 'targets': tokens[:, 1:],
          'segment_ids': np.ones((b, t), np.int32),
          'positions': np.tile(np.arange(t, dtype=np.int32), (b, 1)),
          'loss_mask': np.ones((b, t), np.int32), 'modality': np.zeros((b, t), np.int32)}


def pass_labels(normalizations: int) -> list[str]:
  return ['live rows'] + [f'pass {k} ({"rows" if k % 2 == 0 else "columns"})'
                          for k in range(normalizations)]


def sinkhorn_passes(g_tc, cfg_train):
  """Per pass of train/muon.py `sinkhorn_balance` on g (rows first, then `pass_labels`): (norms
  above 0, min norm, max norm, non-finite values after it)."""
  t = cfg_train
  x = g_tc.astype(jnp.float32)
  row_norm = jnp.linalg.norm(x, axis=1, keepdims=True)
  live = row_norm > t.sinkhorn_tau * jnp.mean(row_norm)
  out = [(jnp.sum(live), jnp.min(row_norm), jnp.max(row_norm),
          jnp.sum(~jnp.isfinite(x)))]
  x = jnp.where(live, x, 0.0)
  for k in range(t.sinkhorn_normalizations):
    norm = jnp.linalg.norm(x, axis=1 if k % 2 == 0 else 0, keepdims=True)
    x = x / (norm + t.sinkhorn_eps)
    out.append((jnp.sum(norm > 0),
                jnp.min(norm), jnp.max(norm), jnp.sum(~jnp.isfinite(x))))
  return out


def division_balance(u_tc, normalizations, tau, eps):
  """train/muon.py `sinkhorn_balance` as it was before 2026-12-05 (each line divided by its norm
  + eps), kept to compare on the device."""
  x = u_tc.astype(jnp.float32)
  row_norm = jnp.linalg.norm(x, axis=1, keepdims=True)
  x = jnp.where(row_norm > tau * jnp.mean(row_norm), x, 0.0)
  for k in range(normalizations):
    x = x / (jnp.linalg.norm(x, axis=1 if k % 2 == 0 else 0, keepdims=True) + eps)
  return x


def main(argv):
  del argv
  cfg = resolve(_CONFIG.value)
  mesh = make_mesh(cfg.mesh)
  tx = make_optimizer(cfg.train)
  state, shardings = state_lib.init_state(cfg, tx, mesh, cfg.mesh.rules)
  md = state_lib.model_def(cfg, tx)
  bsh = batch_sharding(mesh, cfg.mesh.rules)
  batch = {k: jax.device_put(v, bsh) for k, v in synthetic_batch(cfg).items()}
  before = {k: np.asarray(v, np.float32) for k, v in named_leaves(state['params']).items()}
  # Rows a batch never gathers can hide a non-finite initialisation behind a finite loss.
  for name in [n for n, v in before.items() if not np.isfinite(v).all()][:20]:
    print(f'  non-finite BEFORE the update (initialisation): {name}')
  with jax.set_mesh(mesh):
    step = jax.jit(objective_for(cfg).make_train_step(md), in_shardings=(shardings, bsh),
                   out_shardings=(shardings, None))
    new, metrics = step(state, batch)
  print(f"loss {float(metrics['loss']):.6f} grad_norm {float(metrics['grad_norm']):.6f}")
  rows = []
  for name, after in named_leaves(new['params']).items():
    after = np.asarray(after, np.float32)
    delta = after - before[name]
    finite = bool(np.isfinite(after).all())
    rms = float(np.sqrt(np.mean(np.square(delta)))) if finite else float('nan')
    rows.append((not finite, rms, name, after.shape))
  bad = [r for r in rows if r[0]]
  opt_bad = [jax.tree_util.keystr(path) for path, leaf in jax.tree_util.tree_leaves_with_path(
      new['opt']) if hasattr(leaf, 'dtype') and jnp.issubdtype(leaf.dtype, jnp.floating)
      and not bool(jnp.isfinite(leaf).all())]
  print(f'{len(opt_bad)} optimizer state leaves non-finite after the update')
  for path in opt_bad[:20]:
    print(f'  non-finite state: {path}')
  print(f'{len(bad)} of {len(rows)} parameters non-finite after the update')
  for _, _, name, shape in bad[:20]:
    print(f'  non-finite: {name} {shape}')
  for _, rms, name, shape in sorted((r for r in rows if not r[0]), key=lambda r: -r[1])[:10]:
    print(f'  update rms {rms:.3e}: {name} {shape}')
  del new, metrics  # the step's outputs: the gradients below need their memory (1B on 80 GB)
  tables = {n: v for n, v in named_leaves(state['params']).items()}
  names = set(_token_tables(state['params'])) if _TRACE_ALL.value else {r[2] for r in bad}
  bad_tables = sorted(names & set(_token_tables(state['params'])))
  if not bad_tables:
    return
  with jax.set_mesh(mesh):
    grads = jax.jit(lambda st, b: accumulate_gradients(cfg, md, st['params'], st['router_bias'],
                                                       b)[0])(state, batch)
    # The optimizer alone, as its own program: non-finite here means the update's math, finite
    # here but not in the step means how the step's program fused it.
    updates = jax.jit(md.tx.update)(grads, state['opt'], state['params'])[0]
  named, named_updates = named_leaves(grads), named_leaves(updates)
  for name in bad_tables:
    print(f'{name}: the optimizer alone leaves '
          f'{int(jnp.sum(~jnp.isfinite(named_updates[name])))} non-finite update values')
  del updates, named_updates
  t = cfg.train
  for name in bad_tables:
    axis = _token_tables(state['params'])[name]
    g = jnp.moveaxis(named[name], axis, 0)
    u = (1 + t.sinkhorn_momentum) * g.astype(jnp.float32)  # the first Nesterov step's input
    for label, fn in (('balance', sinkhorn_balance), ('balance by division', division_balance)):
      out = jax.jit(fn, static_argnums=(1, 2, 3))(u, t.sinkhorn_normalizations, t.sinkhorn_tau,
                                                  t.sinkhorn_eps)
      print(f'  {label} alone: {int(jnp.sum(~jnp.isfinite(out)))} non-finite')
    print(f'{name} {tables[name].shape}: gradient non-finite {int(jnp.sum(~jnp.isfinite(g)))}, '
          f'|g| max {float(jnp.max(jnp.abs(g))):.3e}, rows touched '
          f'{int(jnp.sum(jnp.any(g != 0, axis=1)))} of {g.shape[0]}')
    passes = jax.jit(sinkhorn_passes, static_argnums=1)(g, cfg.train)
    for label, (count, lo, hi, nonfinite) in zip(
        pass_labels(cfg.train.sinkhorn_normalizations), passes):
      print(f'  {label}: {int(count)} nonzero norms in [{float(lo):.3e}, {float(hi):.3e}], '
            f'{int(nonfinite)} non-finite after')


def _token_tables(params) -> dict[str, int]:
  """{dotted path: token axis} of the TokenTable variables."""
  out = {}
  for path, var in jax.tree_util.tree_flatten_with_path(
      params, is_leaf=lambda x: isinstance(x, nnx.Variable))[0]:
    if isinstance(var, TokenTable):
      out[state_lib._dotted(path)] = token_axis_of(var)
  return out


if __name__ == '__main__':
  app.run(main)
