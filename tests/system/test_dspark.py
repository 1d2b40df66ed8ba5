"""DSpark (model/dspark.py, model/drafting.py, train/objectives/dspark.py): the draft attention pattern, labels and
validity, the frozen stage end to end (the backbone bit-identical, no optimizer state for it, the
held-out acceptance logged), post-training's stop-gradient, and a backbone checkpoint that does
not fit. The loss and acceptance math: tests/unit/test_dspark_objective.py."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from deepseek41.config import resolve
from deepseek41.model.dspark import Anchors, DraftAttention, DSpark, draft_model_config, draft_role
from deepseek41.model.transformer import Transformer
from deepseek41.sharding import make_mesh
from deepseek41.train import state as state_lib
from deepseek41.train.objectives import dspark as dspark_objective, objective_for
from deepseek41.train.checkpoint import CheckpointError, Checkpointer
from deepseek41.train.optimizer import make_optimizer
from deepseek41.train.trainer import train
from tests.helpers import CORPUS_STEPS, REPO_ROOT, packed_batch, small_config

DRAFTER = {'dspark.stage': 'frozen', 'dspark.num_blocks': 1, 'dspark.block_size': 3,
           'dspark.n_routed_experts': 4, 'dspark.num_experts_per_tok': 2,
           'dspark.markov_rank': 8, 'dspark.anchors_per_sequence': 4}


def _cfg(**overrides):
  return resolve(small_config(**{**DRAFTER, **overrides}), num_devices=1, backend='cpu')


def test_draft_rows_see_the_context_ring_and_their_whole_block_only():
  """Perturbation: a row's output moves with every row of its own block (before and after it)
  and with the context features of its ring, never with another anchor's rows."""
  cfg = _cfg()
  attn = DraftAttention(draft_model_config(cfg.model, cfg.dspark), draft_role(99),
                        nnx.Rngs(params=0))
  n, r, w, d = 2, 3, cfg.model.sliding_window, cfg.model.d_model
  ks = jax.random.split(jax.random.key(0), 2)
  x = jax.random.normal(ks[0], (n, r, d))
  m = jax.random.normal(ks[1], (n, w, d))
  ok = jnp.ones((n, w), bool).at[0, :3].set(False)  # anchor 0: ring starts in another document
  batch = {'positions': jnp.array([[20, 21, 22], [30, 31, 32]]),
           'dspark_context': {'m_nwd': m, 'positions_nw': jnp.arange(w)[None] + jnp.array(
               [[12], [22]]), 'ok_nw': ok}}

  def row0_of_anchor0(x, m):
    out, _ = attn(x, {**batch, 'dspark_context': {**batch['dspark_context'], 'm_nwd': m}}, {})
    return jnp.sum(out[0, 0])
  gx, gm = jax.grad(row0_of_anchor0, argnums=(0, 1))(x, m)
  row_moves = np.abs(np.asarray(gx)).sum(-1)
  assert (row_moves[0] > 0).all()      # rows 0, 1, 2 of its block: bidirectional
  assert (row_moves[1] == 0).all()     # nothing of the other anchor
  ring_moves = np.abs(np.asarray(gm)).sum(-1)
  assert (ring_moves[0, 3:] > 0).all() and (ring_moves[0, :3] == 0).all()  # its document only
  assert (ring_moves[1] == 0).all()


def test_drafts_read_only_the_past_and_label_the_future():
  """The drafts of anchor P depend on the context features at P-W..P-1 of its document, not on
  later ones; slot k is labelled with token P+k and valid only inside the anchor's document."""
  cfg = _cfg()
  backbone = Transformer(cfg.model, nnx.Rngs(params=0))
  drafter = DSpark(cfg.model, cfg.dspark, nnx.Rngs(params=1))
  batch = {k: jnp.asarray(v) for k, v in packed_batch(seed=3).items()}
  seg = np.asarray(batch['segment_ids'])
  row = 0
  doc_end = int(np.max(np.nonzero(seg[row] == seg[row, 20])))
  p = doc_end - 1          # slot 1 is the document's last token, slot 2 is past it
  anchors = Anchors(jnp.array([row], jnp.int32), jnp.array([p], jnp.int32))
  m_btd = jax.random.normal(jax.random.key(2), (*seg.shape, cfg.model.d_model))

  def logits_sum(m):
    out = drafter(m, batch, anchors, backbone.embed[...], backbone.head[...])
    return jnp.sum(out.logits_nkv), out
  g, out = jax.grad(logits_sum, has_aux=True)(m_btd)
  moves_t = np.abs(np.asarray(g[row])).sum(-1)
  w = cfg.model.sliding_window
  doc_start = int(np.min(np.nonzero(seg[row] == seg[row, p])))
  seen = np.arange(seg.shape[1])
  expect = (seen < p) & (seen >= max(p - w, doc_start))
  assert (moves_t[expect] > 0).all() and (moves_t[~expect] == 0).all()
  assert (np.abs(np.asarray(g[1 - row])) == 0).all()
  tokens = np.asarray(batch['tokens'])
  np.testing.assert_array_equal(np.asarray(out.labels_nk[0, :2]), tokens[row, p + 1:p + 3])
  assert np.asarray(out.valid_nk[0]).tolist() == [True, False, False]


@pytest.fixture
def pretrained(pretrained_run, corpus):
  """The session's trained run (its last checkpoint) and the overrides it was trained with."""
  return pretrained_run, corpus


def _last_checkpoint(run: str) -> str:
  return os.path.join(run, 'checkpoints', str(CORPUS_STEPS))


def _params_of(workdir, cfg, step, key):
  tx = make_optimizer(cfg.train)
  abstract = state_lib.abstract_state(cfg, tx)
  shardings = state_lib.state_shardings(abstract, make_mesh(cfg.mesh), cfg.mesh.rules)
  ckpt = Checkpointer(workdir, cfg.checkpoint, primary=False)
  state = ckpt.restore(step, state_lib.with_shardings(abstract, shardings), None)
  ckpt.close()
  return state[key], state


def test_frozen_stage_keeps_the_backbone_bit_identical(pretrained, tmp_path):
  run, data = pretrained
  backbone = _last_checkpoint(run)
  overrides = {**DRAFTER, **data, 'dspark.backbone_checkpoint': backbone,
               'train.steps': 3, 'train.eval_every_steps': 3, 'train.eval_batches': 1}
  workdir = str(tmp_path / 'draft')
  train(small_config(**overrides), workdir, stop_at_step=2)
  # The resume reads the stage's own checkpoint (its frozen backbone included), not the backbone's.
  overrides_resume = {**overrides, 'dspark.backbone_checkpoint': str(tmp_path / 'nowhere')}
  assert train(small_config(**overrides_resume), workdir).step == 3

  pre_cfg = resolve(small_config(**data))
  before, _ = _params_of(run, pre_cfg, CORPUS_STEPS, 'params')
  cfg = resolve(small_config(**overrides_resume))
  after, state = _params_of(workdir, cfg, 3, 'frozen')
  for x, y in zip(jax.tree.leaves(before), jax.tree.leaves(after['backbone']), strict=True):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
  # The optimizer holds the drafter's parameters only (Adam: two moments each, plus counts).
  n_drafter = sum(x.size for x in jax.tree.leaves(state['params']))
  n_backbone = sum(x.size for x in jax.tree.leaves(state['frozen']))
  n_opt = sum(x.size for x in jax.tree.leaves(state['opt']))
  assert n_opt < 2 * n_drafter + 16 and n_backbone > 0
  assert all('dspark' == str(p[0].key) for p, _ in
             jax.tree_util.tree_flatten_with_path(state['params'])[0])
  records = [json.loads(line) for line in open(os.path.join(workdir, 'metrics.jsonl'))]
  last = records[-1]
  assert 1.0 <= last['eval_dspark_accept_len'] <= 1.0 + 2 * 1.0 and \
      0 <= last['eval_dspark_accept/1'] <= 1 and last['eval_dspark_ece'] <= \
      last['eval_dspark_ece_raw'] + 1e-6
  assert 'dspark_ce' in records[-2] or 'dspark_ce' in last


def test_post_training_leaves_the_backbone_gradients_unchanged():
  """The drafter's loss reaches only the drafter: the backbone's gradients with it equal those
  of the backbone's objective alone."""
  cfg = _cfg(**{'dspark.stage': 'post_training'})
  tx = make_optimizer(cfg.train)
  md = state_lib.model_def(cfg, tx)
  state = jax.jit(state_lib._init_fn(cfg, tx))()
  batch = {k: jnp.asarray(v) for k, v in packed_batch(seed=1).items()}
  key = jax.random.key(0)

  def grads(with_drafter):
    return jax.grad(lambda p: dspark_objective.stage_loss(
        cfg, md.graphdef, p, None, state['router_bias'], batch, key, with_drafter)[0])(
            state['params'])
  g_all, g_backbone_only = grads(True), grads(False)
  for x, y in zip(jax.tree.leaves(g_all['backbone']), jax.tree.leaves(g_backbone_only['backbone'])):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
  assert any(float(jnp.abs(x).sum()) > 0 for x in jax.tree.leaves(g_all['dspark']))


def test_a_backbone_checkpoint_of_another_model_says_what_differs(pretrained, tmp_path):
  run, data = pretrained
  overrides = {**DRAFTER, **data, 'model.moe_intermediate_size': 24,
               'dspark.backbone_checkpoint': _last_checkpoint(run)}
  with pytest.raises(CheckpointError, match=r'dspark\.backbone_checkpoint: .*moe_intermediate_size'):
    train(small_config(**overrides), str(tmp_path / 'bad'))
  with pytest.raises(CheckpointError, match=r'not a checkpoint step directory'):
    train(small_config(**{**overrides, 'dspark.backbone_checkpoint': run}),
          str(tmp_path / 'bad2'))


def test_cli_stage_without_a_backbone_says_so(tmp_path):
  """The trainer's CLI runs the stage's set-up (FLOPs, state, backbone restore) and names the
  missing backbone."""
  import subprocess
  import sys
  root = REPO_ROOT
  env = dict(os.environ, PYTHONPATH=root, JAX_PLATFORMS='cpu')
  out = subprocess.run(
      [sys.executable, '-m', 'deepseek41.train', '--config=configs/tiny_dspark.py',
       f'--workdir={tmp_path}/run', f'--config.dspark.backbone_checkpoint={tmp_path}/none/1',
       f'--config.data.cache_dir={tmp_path}/cache', '--config.data.synthetic=True',
       '--config.log.progress_bar=False'],
      cwd=root, env=env, capture_output=True, text=True, timeout=300)
  assert out.returncode != 0
  assert 'dspark.backbone_checkpoint' in out.stderr and 'not a checkpoint step directory' in \
      out.stderr, out.stderr[-3000:]
  assert 'DSpark stage FLOPs/token' in out.stderr


def test_stage_on_an_fsdp_expert_tensor_mesh_matches_data_parallel(pretrained, tmp_path):
  """The drafter's blocks, MoE exchange and heads sharded over fsdp x expert x tensor train
  exactly as on a data-parallel mesh (same anchors, same losses)."""
  run, data = pretrained
  losses = {}
  for name, mesh in [('data8', {'mesh.data': -1}),
                     ('split', {'mesh.data': 1, 'mesh.fsdp': 2, 'mesh.expert': 2,
                                'mesh.tensor': 2})]:
    overrides = {**DRAFTER, **data, **mesh, 'train.steps': 2,
                 'dspark.backbone_checkpoint': _last_checkpoint(run)}
    train(small_config(**overrides), str(tmp_path / name))
    rows = [json.loads(line) for line in open(tmp_path / name / 'metrics.jsonl')]
    losses[name] = [r['loss'] for r in rows if r.get('loss') is not None]
  assert len(losses['data8']) == 2
  np.testing.assert_allclose(losses['split'], losses['data8'], rtol=1e-5)


def test_post_training_without_a_backbone_starts_both_from_initialization(tmp_path, caplog):
  """post_training with no dspark.backbone_checkpoint trains backbone and drafter from their
  initialization (its backbone changes); the frozen stage still needs one."""
  import logging
  overrides = {**DRAFTER, 'dspark.stage': 'post_training', 'train.steps': 2,
               'checkpoint.every_steps': 2}
  with caplog.at_level(logging.INFO):
    assert train(small_config(**overrides), str(tmp_path / 'joint')).step == 2
  assert 'both start from initialization' in caplog.text
  cfg = resolve(small_config(**overrides))
  trained, _ = _params_of(str(tmp_path / 'joint'), cfg, 2, 'params')
  init, _ = objective_for(cfg).split(state_lib.build_model(cfg))[1:3]
  changed = [not np.array_equal(a, b) for a, b in
             zip(jax.tree.leaves(trained['backbone']), jax.tree.leaves(init['backbone']))]
  assert any(changed)
  with pytest.raises(CheckpointError, match='dspark.backbone_checkpoint'):
    train(small_config(**DRAFTER), str(tmp_path / 'frozen'))
