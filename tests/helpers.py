"""The one helper module of the tests: the repository root, small configs, batches, layouts and
shared test shapes (every tier imports from here; no test file imports another)."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from deepseek41.batch import (IMAGE, ROLE_END, ROLE_NEWLINE, ROLE_PATCH, ROLE_START, TEXT,
                              span_length)
from deepseek41.config import base_config, load_config_file, resolve
from deepseek41.data.prepare import prepare_dataset
from deepseek41.model.compressor import CompressedKV, group_layout, visible_btn
from deepseek41.model.indexer import select_topk
from deepseek41.model.transformer import Transformer
from deepseek41.sharding import make_mesh
from deepseek41.train import state as state_lib
from deepseek41.train.checkpoint import Checkpointer
from deepseek41.train.optimizer import make_optimizer
from deepseek41.train.step import accumulate_gradients, forward_loss, make_train_step
from deepseek41.train.trainer import train

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

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
  # AdamW: its update is a few element-wise passes, Newton-Schulz twice the toy model's FLOPs.
  # The hybrid optimizer's own tests (test_optimizer, test_muon_hybrid) choose it explicitly.
  c.train.optimizer = 'adamw'
  c.data.seq_len = T
  c.data.synthetic = True
  c.train.batch_size = B
  c.train.steps = 4
  c.train.warmup_steps = 1
  c.train.eval_every_steps = 0
  # The trainer's persistent cache: the suite's own (conftest.py), not the user's; none where
  # conftest did not run (a subprocess's config file passes the suite's explicitly).
  c.train.compilation_cache_dir = jax.config.jax_compilation_cache_dir or ''
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


def four_layer_tiny(remat: str = 'block'):
  """configs/tiny.py's shapes on four layers that still hold every role (SWA, ratio-2 and
  ratio-1 KV sources, the candidate source, a Reindex layer, Engram): its full step compiles
  in about 40 s instead of tiny's 8-layer 110 s. Block remat, as the shipped large configs."""
  c = load_config_file(os.path.join(REPO_ROOT, 'configs', 'tiny.py'))
  m = c.model
  m.num_layers, m.num_encoder_layers = 4, 2
  m.compress_ratios = (0, 2, 1, 1)
  m.kv_source_layer_ids, m.index_source_layer_ids = (1, 2), (1, 2, 3)
  m.candidate_source_layer_id, m.engram_layer_ids = 2, (1,)
  c.train.remat = remat
  return c


# ---- the session's trained run (fixtures: tests/conftest.py makes them visible) -------------

CORPUS_STEPS = 8


def _shared_root(tmp_path_factory) -> str:
  """The folder every xdist worker of this pytest run shares (each worker's own base folder is
  a child of it); the base folder itself without xdist."""
  base = tmp_path_factory.getbasetemp()
  return str(base.parent if os.environ.get('PYTEST_XDIST_WORKER') else base)


@contextlib.contextmanager
def _locked(path: str):
  """An exclusive lock between the run's processes (released if a holder dies)."""
  with open(path, 'a') as f:
    fcntl.flock(f, fcntl.LOCK_EX)
    try:
      yield
    finally:
      fcntl.flock(f, fcntl.LOCK_UN)


@pytest.fixture(scope='session')
def corpus(tmp_path_factory):
  """Overrides that train the small model on a 20-file slice of the default corpus, prepared
  once for the whole run: the workers share its cache (preparing is safe against a concurrent
  preparer: the first atomic rename wins, data/default_corpus.py)."""
  cache = os.path.join(_shared_root(tmp_path_factory), 'corpus-cache')
  os.makedirs(cache, exist_ok=True)
  return {
      'data.synthetic': False,
      'data.cache_dir': cache,
      'data.default_corpus_vocab_size': 300,
      'data.default_corpus_max_files': 20,
      'model.vocab_size': 320,
      'mesh.data': -1,
      'train.steps': CORPUS_STEPS,
  }


def corpus_config(corpus: dict, **overrides):
  """The config of the session's trained run, with `overrides`."""
  return small_config(**{**corpus, **overrides})


@pytest.fixture(scope='session')
def pretrained_run(corpus, tmp_path_factory) -> str:
  """The run's one trained run (`corpus_config(corpus)`, saving every CORPUS_STEPS / 2
  steps): CORPUS_STEPS steps, checkpoints at the half and the end, its tokenizer.json beside
  them. The first worker to ask trains it; the others wait and share it. Tests read it, or
  copy it to change it; resume, fault, generation and DSpark tests start from it."""
  root = os.path.join(_shared_root(tmp_path_factory), 'pretrained')
  workdir, done = os.path.join(root, 'run'), os.path.join(root, 'trained')
  with _locked(root + '.lock'):
    if not os.path.exists(done):  # none yet, or a worker failed part-way: train afresh
      shutil.rmtree(root, ignore_errors=True)
      config = corpus_config(corpus, **{'checkpoint.every_steps': CORPUS_STEPS // 2})
      assert train(config, workdir).step == CORPUS_STEPS
      open(done, 'w').close()
  return workdir


WORDS = ('river stone market lantern harbor meadow copper window garden silver orchard '
         'valley thunder pepper candle').split()


def prepare_sentences(root, vocab_size: int, extra_lines: list[str] = ()) -> str:
  """A prepared dataset (train and held-out splits) of 60 plain sentences of WORDS, plus
  `extra_lines`, under `root`; its directory, for data.sources."""
  rng = np.random.default_rng(0)
  lines = [' '.join(rng.choice(WORDS, 12)) + '.' for _ in range(60)] + list(extra_lines)
  jsonl = os.path.join(root, 'docs.jsonl')
  with open(jsonl, 'w') as f:
    f.write('\n'.join(json.dumps({'text': t}) for t in lines) + '\n')
  return prepare_dataset([jsonl], os.path.join(root, 'data'), vocab_size=vocab_size,
                         heldout_fraction=0.3, progress=False)


def random_like(params, seed: int):
  """A tree of standard-normal arrays shaped like `params`."""
  leaves, treedef = jax.tree.flatten(params)
  keys = jax.random.split(jax.random.key(seed), len(leaves))
  return jax.tree.unflatten(treedef, [jax.random.normal(k, x.shape, x.dtype)
                                      for k, x in zip(keys, leaves)])


def leaf_value(tree, *path) -> np.ndarray:
  """The array at `path` of a state tree (a Variable's value, or the array itself)."""
  node = tree
  for p in path:
    node = node[p]
  return np.asarray(node.get_value() if isinstance(node, nnx.Variable) else node)


def final_state(workdir: str, config) -> tuple[int, dict]:
  """(step, state) of the newest checkpoint of `workdir`, restored under `config`."""
  cfg = resolve(config)
  tx = make_optimizer(cfg.train)
  abstract = state_lib.abstract_state(cfg, tx)
  shardings = state_lib.state_shardings(abstract, make_mesh(cfg.mesh), cfg.mesh.rules)
  ck = Checkpointer(workdir, cfg.checkpoint)
  step = ck.latest_step()
  state = ck.restore(step, state_lib.with_shardings(abstract, shardings), None)
  ck.close()
  return step, state


def logged_losses(workdir: str) -> dict[int, float]:
  """{step: training loss} of a run's metrics.jsonl."""
  with open(os.path.join(workdir, 'metrics.jsonl')) as f:
    return {d['step']: d['loss'] for d in map(json.loads, f) if 'loss' in d}


def resolved(num_devices=1, **overrides):
  return resolve(small_config(**overrides), num_devices=num_devices, backend='cpu')


def one_train_step(**overrides):
  """(gradients, new state, metrics) of one train step of `resolved(**overrides)` from its
  initialisation, on one device, on `packed_batch(seed=3)` with image rows 0 and 7."""
  cfg = resolved(**overrides)
  tx = make_optimizer(cfg.train)
  mesh = make_mesh(cfg.mesh, jax.devices()[:1])
  state, _ = state_lib.init_state(cfg, tx, mesh, cfg.mesh.rules)
  md = state_lib.model_def(cfg, tx)
  batch = packed_batch(seed=3, image_rows=(0, 7))
  step = make_train_step(cfg, md)

  # One program (XLA merges the two gradient computations): a fifth less compile than two.
  def grads_and_step(state, batch):
    grads = accumulate_gradients(cfg, md, state['params'], state['router_bias'], batch)[0]
    return grads, *step(state, batch)
  return jax.jit(grads_and_step)(state, batch)


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


# ---- images (the vision tests and the kernels' image-span cases) ----------------------------

PATCH, MERGE, MAX_TOKENS, SLOTS = 2, 3, 4, 2
P = MERGE * MERGE * MAX_TOKENS
VISION = {'model.vision': True, 'model.vision_layers': 1, 'model.vision_dim': 16,
          'model.vision_heads': 2, 'model.vision_mlp': 16, 'model.vision_patch': PATCH,
          'model.vision_max_image_tokens': MAX_TOKENS, 'model.image_token_id': 5,
          'data.max_images_per_row': SLOTS}


def image_batch(seed=0, b=2, spans=((6, (4, 4)), (26, (6, 3)))):
  """Rows of one document: text, then images at the given starts with (h, w) patch grids."""
  rng = np.random.default_rng(seed)
  tokens = rng.integers(6, 96, (b, T)).astype(np.int32)
  role = np.zeros((b, T), np.int32)
  index = np.zeros((b, T), np.int32)
  span = np.zeros((b, T), np.int32)
  patches = np.zeros((b, SLOTS, P, PATCH * PATCH * 3), np.uint8)
  grid = np.zeros((b, SLOTS, 2), np.int32)
  for n, (start, (h, w)) in enumerate(spans):
    hm, wm = -(-h // MERGE), -(-w // MERGE)
    roles = [ROLE_START]
    idx = [0]
    for i in range(hm):
      roles += [ROLE_PATCH] * wm + [ROLE_NEWLINE]
      idx += [n * MAX_TOKENS + i * wm + j for j in range(wm)] + [0]
    roles.append(ROLE_END)
    idx.append(0)
    end = start + span_length(hm, wm)
    assert len(roles) == end - start
    role[:, start:end] = roles
    index[:, start:end] = idx
    span[:, start:end] = n + 1
    tokens[:, start:end] = 5
    grid[:, n] = (h, w)
    patches[:, n, :h * w] = rng.integers(0, 256, (b, h * w, PATCH * PATCH * 3))
  modality = np.where(role != 0, IMAGE, TEXT).astype(np.int32)
  targets = np.roll(tokens, -1, axis=1)
  loss_mask = np.ones((b, T), np.int32)
  loss_mask[:, :-1] &= (role[:, 1:] == 0)
  return {'tokens': tokens, 'targets': targets, 'segment_ids': np.ones((b, T), np.int32),
          'positions': np.tile(np.arange(T, dtype=np.int32), (b, 1)), 'loss_mask': loss_mask,
          'modality': modality, 'image_role': role, 'image_index': index, 'image_span': span,
          'image_patches': patches, 'image_grid': grid}


# ---- the kernels' model shapes and meshes (tests/kernels) ------------------------------------

KERNEL_SHAPES = {'model.attention_variant': 'csa2', 'model.num_heads': 16, 'model.o_groups': 2,
                 'model.index_n_heads': 2, 'model.index_head_dim': 8, 'model.sparse_chunk': 16,
                 'model.index_topk_block': 2}

RELEASED_QUANT = {'model.kv_quant': 'fp4_e4m3_16', 'model.index_quant': 'fp4_ue8m0_32',
                  'model.swa_quant': 'fp8_ue8m0_32',  # blocks of 32: widths of 32
                  'model.head_dim': 32, 'model.index_head_dim': 32}
MESH_KERNEL_SHAPES = {**KERNEL_SHAPES, 'model.residual': 'mhc_single_pass', 'model.engram': True}
# GPU-only choices for the config, so set past its checks (as tests/kernels/test_fused_model.py does).
EVERY_KERNEL = dict(sparse_impl='fused', attention_impl='fused', select_impl='threshold',
                    mhc_impl='fused', moe_backend='grouped')


def model_loss_fn(cfg, tx):
  md = state_lib.model_def(cfg, tx)

  def loss_fn(params, biases, b):
    ce, cnt, _ = forward_loss(md, params, biases, b)
    return ce / cnt
  return loss_fn


def kernels_outside_shard_map(jaxpr, inside=False, primitive='pallas_call'):
  """Names of `primitive` eqns (pallas_calls) not nested in a shard_map, walking every
  sub-jaxpr."""
  found = []
  for eqn in jaxpr.eqns:
    name = eqn.primitive.name
    if name == primitive and not inside:
      found.append(eqn.params.get('name') or eqn.params.get('name_and_src_info', name))
    for sub in sub_jaxprs(eqn.params.values()):
      found += kernels_outside_shard_map(sub, inside or name == 'shard_map', primitive)
  return found


def sub_jaxprs(values):
  for v in values:
    if hasattr(v, 'eqns'):
      yield v
    elif hasattr(getattr(v, 'jaxpr', None), 'eqns'):  # a closed jaxpr
      yield v.jaxpr
    elif isinstance(v, (tuple, list)):
      yield from sub_jaxprs(v)


# ---- selections and entry layouts (indexer, top-k and sparse kernel tests) ------------------

def random_selection(key, b, t, n, k, ratio=2, prefix=True):
  """A causal top-k selection over n entries with two documents per row; some queries see none."""
  seg_bt = jnp.where(jnp.arange(t) < t // 2, 1, 2)[None].repeat(b, 0)
  seg_bt = seg_bt.at[:, -3:].set(0)  # padding tail
  entry_seg_bn = seg_bt[:, ::ratio][:, :n]
  row_t = jnp.arange(t)
  visible_btn = ((jnp.arange(n)[None, None, :] < ((row_t + 1) // ratio)[None, :, None]) &
                 (entry_seg_bn[:, None, :] == seg_bt[:, :, None]) & (seg_bt[:, :, None] > 0))
  scores_btn = jax.random.normal(key, (b, t, n))
  idx_btk, valid_btk = select_topk(scores_btn, visible_btn, k)
  if not prefix:  # valid slots scattered through the row: the kernel must not assume a prefix
    perm = jax.random.permutation(jax.random.fold_in(key, 1), k)
    idx_btk, valid_btk = idx_btk[..., perm], valid_btk[..., perm]
  return idx_btk, valid_btk


# Reuse layers: 1-3 read layer 1's KV and selection, 4-5 layer 4's (two groups that defer their
# key/value gradient to the index source, `model.sparse_group_dkv`).
GROUPED = {'model.num_layers': 6, 'model.num_encoder_layers': 4,
           'model.compress_ratios': (0, 2, 2, 2, 1, 1), 'model.kv_source_layer_ids': (1, 4),
           'model.index_source_layer_ids': (1, 4), 'model.candidate_source_layer_id': 4}


DOCS = ((20, 7, 16), (30, 13))   # misaligned documents and padding in both rows


def entry_layout(ratio, docs=DOCS, t=T):
  """(segment ids, positions, the entries' layout, the dense visibility [B, T, N]) of packed
  documents."""
  seg, pos = packed_layout(docs, t)
  pos_bn, seg_bn, last_bn = group_layout(seg, pos, ratio)
  comp = CompressedKV(latent_bnd=None, kv_bnd=None, pos_bn=pos_bn, seg_bn=seg_bn,
                      last_bn=last_bn, ratio=ratio)
  return seg, pos, comp, np.asarray(visible_btn(seg, comp))


def first_visible(vis):
  """The document's first entry as the smallest visible one (-1: none), from the dense mask."""
  return np.where(vis.any(-1), np.argmax(vis, -1), -1).astype(np.int32)


# CSA2 at the small config's sizes, the two-stage top-k active
CSA2_SMALL = {'model.attention_variant': 'csa2', 'model.index_n_heads': 2,
              'model.index_head_dim': 8, 'model.sparse_chunk': 16, 'model.index_topk_block': 2}


def aligned_batch(seed):
  """Documents of even length, so ratio-2 groups never straddle (the packer's alignment)."""
  batch = packed_batch(seed=seed, docs_per_row=2, pad=4)
  seg = batch['segment_ids']
  for r in range(seg.shape[0]):
    first = np.argmax(seg[r] == 2)
    if first % 2:  # move the boundary one token later
      seg[r, first] = 1
      batch['positions'][r, first] = batch['positions'][r, first - 1] + 1
      batch['positions'][r, first + 1:][seg[r, first + 1:] == 2] -= 1
  batch['loss_mask'] = (seg > 0).astype(np.int32)
  return batch


# The DSpark stage trained beside its backbone (no backbone checkpoint needed)
DRAFTER = {'dspark.stage': 'post_training', 'dspark.num_blocks': 1, 'dspark.block_size': 3,
           'dspark.n_routed_experts': 4, 'dspark.num_experts_per_tok': 2,
           'dspark.markov_rank': 8, 'dspark.anchors_per_sequence': 4}


def singular_values(x):
  return np.linalg.svd(np.asarray(x, np.float64), compute_uv=False)


def documents(t: int, lengths_per_row) -> np.ndarray:
  """[B, T] int32 segment ids: each row's documents (ids 1, 2, ...) back to back, then padding
  (0)."""
  out = np.zeros((len(lengths_per_row), t), np.int32)
  for row, lengths in enumerate(lengths_per_row):
    start = 0
    for k, n in enumerate(lengths):
      out[row, start:start + n] = k + 1
      start += n
  return out


def assert_partial_close(o, lse, o_ref, lse_ref, blind, *, atol_o: float, atol_lse: float):
  """An attention partial (o [B, T, H, d] bf16, lse [B, T, H] fp32) against its reference: close
  where a query sees something; exactly o = 0 and lse = -inf at the `blind` [B, T] queries,
  which must exist (the test would not hold them otherwise)."""
  assert o.shape == o_ref.shape and o.dtype == jnp.bfloat16
  assert lse.shape == o.shape[:3] and lse.dtype == jnp.float32
  o, lse, lse_ref = np.asarray(o, np.float32), np.asarray(lse), np.asarray(lse_ref)
  np.testing.assert_allclose(o, np.asarray(o_ref, np.float32), atol=atol_o)
  np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(lse_ref))
  np.testing.assert_allclose(lse, lse_ref, atol=atol_lse)  # -inf == -inf passes
  blind = np.asarray(blind)
  assert blind.any() and np.all(o[blind] == 0) and np.all(np.isneginf(lse[blind]))
  return o, lse
