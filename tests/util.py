"""Shared small configs and batches for the CPU tests."""

from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from deepseek41.config import base_config, resolve
from deepseek41.model.transformer import Transformer
from deepseek41.train.optimizer import make_optimizer

B, T, VOCAB = 8, 48, 96


def small_config(**overrides):
  """The V4.1 block structure at toy size (~0.15M params): quick to compile on 2 cores."""
  c = base_config()
  m = c.model
  m.vocab_size = VOCAB
  m.d_model = 32
  m.num_layers = 4
  m.num_encoder_layers = 2
  m.num_heads = 4
  m.head_dim = 16
  m.rope_head_dim = 8
  m.q_lora_rank = 16
  m.o_groups = 2
  m.o_lora_rank = 16
  m.sliding_window = 8
  m.compress_ratios = (0, 2, 1, 1)
  m.kv_source_layer_ids = (1, 2)
  m.index_source_layer_ids = (1, 2, 3)
  m.candidate_source_layer_id = 2
  m.engram_layer_ids = (1,)
  m.n_routed_experts = 8
  m.num_experts_per_tok = 2
  m.moe_intermediate_size = 16
  m.compute_dtype = 'float32'
  # The pre-mHC core keeps the suite's many compiles cheap; mHC, Engram and CED have their own
  # tests (test_mhc, test_engram, test_ced) and test_train trains with them on.
  m.residual = 'plain'
  m.engram = False
  m.capacity_factor = 4.0  # = E / K: nothing can drop
  c.data.seq_len = T
  c.data.synthetic = True
  c.train.batch_size = B
  c.train.steps = 4
  c.train.warmup_steps = 1
  c.train.eval_every_steps = 0
  # The trainer's persistent cache: the suite's own (conftest.py), not the user's.
  c.train.compilation_cache_dir = jax.config.jax_compilation_cache_dir
  c.log.progress_bar = False
  c.log.tensorboard = False
  c.log.every_steps = 1
  c.checkpoint.every_steps = 0
  c.checkpoint.async_save = False
  for key, value in overrides.items():
    node = c
    *parents, leaf = key.split('.')
    for p in parents:
      node = node[p]
    node[leaf] = value
  return c


def resolved(num_devices=1, **overrides):
  return resolve(small_config(**overrides), num_devices=num_devices, backend='cpu')


def packed_batch(seed=0, b=B, t=T, vocab=VOCAB, docs_per_row=3, pad=5, image_rows=()):
  """Rows of several documents plus trailing padding, with per-document positions."""
  rng = np.random.default_rng(seed)
  tokens = rng.integers(3, vocab, (b, t)).astype(np.int32)
  targets = rng.integers(3, vocab, (b, t)).astype(np.int32)
  seg = np.zeros((b, t), np.int32)
  pos = np.zeros((b, t), np.int32)
  for r in range(b):
    cuts = np.sort(rng.choice(np.arange(4, t - pad - 4), docs_per_row - 1, replace=False))
    bounds = [0, *cuts, t - pad]
    for i in range(docs_per_row):
      seg[r, bounds[i]:bounds[i + 1]] = i + 1
      pos[r, bounds[i]:bounds[i + 1]] = np.arange(bounds[i + 1] - bounds[i])
  modality = np.zeros((b, t), np.int32)
  for r in image_rows:
    modality[r] = 1
  return {'tokens': tokens, 'targets': targets, 'segment_ids': seg, 'positions': pos,
          'loss_mask': (seg > 0).astype(np.int32), 'modality': modality}


def packed_layout(doc_lengths, t):
  """(segment_ids, positions) [rows, t] for rows of consecutive documents, then padding."""
  seg = np.zeros((len(doc_lengths), t), np.int32)
  pos = np.zeros((len(doc_lengths), t), np.int32)
  for r, lengths in enumerate(doc_lengths):
    start = 0
    for k, n in enumerate(lengths):
      seg[r, start:start + n] = k + 1
      pos[r, start:start + n] = np.arange(n)
      start += n
    assert start <= t
  return seg, pos


def token_ce(model, batch):
  """Per-token cross-entropy [B, T] (0 on padding): the quantity perturbation tests compare."""
  logits, _ = model(batch)
  lse = jax.nn.logsumexp(logits, axis=-1)
  tgt = jnp.take_along_axis(logits, batch['targets'][..., None], axis=-1)[..., 0]
  return (lse - tgt) * batch['loss_mask']


def np_rope(x, pos, inv_freq):
  """float64 RoPE on the last 2*len(inv_freq) channels, adjacent pairs (tests' reference)."""
  x = np.array(x, np.float64)
  half = len(inv_freq)
  ang = pos[..., None].astype(np.float64) * inv_freq.astype(np.float64)
  while ang.ndim < x.ndim:          # broadcast over heads
    ang = ang[..., None, :]
  r = x[..., -2 * half:]
  e, o = r[..., 0::2].copy(), r[..., 1::2].copy()
  r[..., 0::2] = e * np.cos(ang) - o * np.sin(ang)
  r[..., 1::2] = e * np.sin(ang) + o * np.cos(ang)
  x[..., -2 * half:] = r
  return x


def take_batches(ds, n=None) -> list[dict[str, np.ndarray]]:
  """Up to n batches (all if None), closing the iterator so worker shared memory is released."""
  it = iter(ds)
  try:
    out = []
    for batch in it:
      out.append({k: np.array(v) for k, v in batch.items()})
      if n is not None and len(out) == n:
        break
    return out
  finally:
    it.close()


def first_update_ratios(overrides: dict, scaled: dict, plain: dict, ratio_of) -> int:
  """Checks the first optimizer update under `scaled` is ratio_of(path) x the one under `plain`.

  All-ones gradients, no clipping or weight decay; returns how many leaves had a ratio != 1.
  """
  common = {'train.grad_clip_norm': 0.0, 'train.weight_decay': 0.0, **overrides}
  cfg = resolved(**common, **scaled)
  params = nnx.state(Transformer(cfg.model, nnx.Rngs(params=0)), nnx.Param)
  grads = jax.tree.map(jnp.ones_like, params)
  updates = []
  for c in (cfg, resolved(**common, **plain)):
    tx = make_optimizer(c.train)
    updates.append(tx.update(grads, tx.init(params), params)[0])
  scaled_leaves = 0
  for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(updates[0])[0],
                          jax.tree.leaves(updates[1])):
    name = jax.tree_util.keystr(path)
    ratio = ratio_of(name)
    np.testing.assert_allclose(np.asarray(a), ratio * np.asarray(b), rtol=1e-6, err_msg=name)
    scaled_leaves += ratio != 1.0
  return scaled_leaves


def jaxpr_eqns(jaxpr):
  """Every equation of a jaxpr, its sub-jaxprs' included."""
  for e in jaxpr.eqns:
    yield e
    for v in e.params.values():
      for sub in v if isinstance(v, (list, tuple)) else [v]:
        sub = getattr(sub, 'jaxpr', sub)
        if hasattr(sub, 'eqns'):
          yield from jaxpr_eqns(sub)


@contextlib.contextmanager
def triton_lowering_for_h200():
  """Answer the Pallas Triton lowering's GPU query with an H200, so that `.lower(lowering_platforms=
  ('cuda',))` works on the CPU (no GPU, no Triton compile). Skips where the private hook moved."""
  import pytest  # noqa: PLC0415 (tests only)
  gpu_info = pytest.importorskip('jax._src.pallas.triton.gpu_info')
  registration = pytest.importorskip('jax._src.pallas.triton.pallas_call_registration')
  pytest.importorskip('jax.experimental.pallas.triton')
  h200 = gpu_info.GpuInfo(gpu_version=gpu_info.GpuVersion.H200, arch_name='sm_90',
                          compute_capability=90)
  original = registration.gpu_info_lib.get_gpu_info
  registration.gpu_info_lib.get_gpu_info = lambda *a, **k: h200
  try:
    yield
  finally:
    registration.gpu_info_lib.get_gpu_info = original
