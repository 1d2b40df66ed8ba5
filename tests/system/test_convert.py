"""HF interop (deepseek41/interop, tools/convert.py; docs/hf_interop.md): round trips, the
released storage formats, refusals that name the culprit, streaming host memory."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap

import jax
import ml_dtypes
import numpy as np
import pytest

from deepseek41.interop import hf_convert, hf_layout, safetensors_io, storage
from deepseek41.interop.hf_config import HFConfigError
from deepseek41.interop.hf_convert import ConvertError
from deepseek41.quant import get_fake_quant
from deepseek41.sharding import make_mesh
from deepseek41.train import state as state_lib
from deepseek41.train.checkpoint import Checkpointer
from deepseek41.train.optimizer import make_optimizer
from tests.helpers import REPO_ROOT, resolved, small_config

# Its tests share what they build (module fixtures, cached references): one worker runs the
# whole file (tests/conftest.py).
pytestmark = pytest.mark.xdist_group(__name__)

# Every layer role: SWA, Full r=2, Reuse r=2, Full r=1 + candidate pool, Reindex, Reuse; Engram
# before layers 1 and 4; single-pass mHC. Widths are multiples of 32 so every FP8/FP4 format
# applies (scale blocks of 32).
TOY = {
    'model.residual': 'mhc_single_pass', 'model.engram': True, 'model.attention_variant': 'csa2',
    'model.q_head_norm': False, 'model.num_layers': 6, 'model.num_encoder_layers': 3,
    'model.compress_ratios': (0, 2, 2, 1, 1, 1), 'model.kv_source_layer_ids': (1, 3),
    'model.index_source_layer_ids': (1, 3, 4), 'model.candidate_source_layer_id': 3,
    'model.engram_layer_ids': (1, 4), 'model.d_model': 64, 'model.head_dim': 32,
    'model.q_lora_rank': 32, 'model.o_lora_rank': 32, 'model.moe_intermediate_size': 32,
    'model.engram_head_dim': 32, 'model.kv_quant': 'fp4_e4m3_16',
    'model.index_quant': 'fp4_ue8m0_32', 'model.swa_quant': 'fp8_ue8m0_32',
}


def _quiet(_):
  pass


def _restore(workdir, run):
  tx = make_optimizer(run.train)
  abstract = state_lib.abstract_state(run, tx)
  shardings = state_lib.state_shardings(abstract, make_mesh(run.mesh), run.mesh.rules)
  ckpt = Checkpointer(workdir, run.checkpoint, primary=False)
  try:
    return ckpt.restore(0, state_lib.with_shardings(abstract, shardings), None)
  finally:
    ckpt.close()


def _named(tree):
  return {k: np.asarray(v) for k, v in state_lib.named_leaves(tree).items()}


@pytest.fixture(scope='module')
def trained(tmp_path_factory):
  """(config dict, run, workdir): a random toy model saved as step 0, router biases nonzero."""
  root = tmp_path_factory.mktemp('convert')
  c = small_config(**TOY)
  run = resolved(num_devices=jax.device_count(), **TOY)
  tx = make_optimizer(run.train)
  state, _ = state_lib.init_state(run, tx, make_mesh(run.mesh), run.mesh.rules)
  noise = jax.random.normal(jax.random.key(7), (2, run.model.n_routed_experts))
  state['router_bias'] = jax.tree.map(lambda b: b + noise, state['router_bias'])
  workdir = str(root / 'run')
  ckpt = Checkpointer(workdir, run.checkpoint)
  ckpt.save(0, state, None, run.to_dict(),
            state_lib.state_layout(state_lib.abstract_state(run, tx)))
  ckpt.close()
  return c, run, workdir, root


def test_round_trip_is_bit_identical(trained):
  c, run, workdir, root = trained
  hf_convert.export_hf(workdir, str(root / 'hf32'), dtype='fp32', progress=False, say=_quiet)
  with open(root / 'hf32' / 'config.json') as f:
    text = json.load(f)['text_config']
  assert text['compress_ratios'] == [0, 2, 2, 1, 1, 1] and text['engram_layer_ids'] == [1, 4]
  step_dir = hf_convert.import_hf(str(root / 'hf32'), str(root / 'imported'), base=c,
                                  progress=False, say=_quiet)
  assert step_dir.endswith('imported/checkpoints/0')
  before, after = _restore(workdir, run), _restore(str(root / 'imported'), run)
  for group in ('params', 'router_bias'):
    a, b = _named(before[group]), _named(after[group])
    assert a.keys() == b.keys()
    for k in a:
      np.testing.assert_array_equal(a[k], b[k], err_msg=f'{group} {k}')
  assert np.any(_named(after['router_bias'])['blocks.2.moe.router_bias'][1] != 0)
  # The written run config reproduces the model, with the HF equivalence switches set.
  from deepseek41.config import load_config_file, resolve
  again = resolve(load_config_file(str(root / 'imported' / 'config.py')), backend='cpu')
  assert again.model == run.model
  report = json.loads((root / 'imported' / 'import_report.json').read_text())
  assert any('q_head_norm=False' in n for n in report['notes'])

  # A new run (other optimizer settings) starts from the imported weights: checkpoint.init_from.
  from deepseek41.train.checkpoint import CheckpointError
  from deepseek41.train.warm_start import load_warm_starts
  fresh_cfg = resolved(num_devices=jax.device_count(), **TOY, **{
      'checkpoint.init_from': step_dir, 'train.engram_table_lr_multiplier': 1.0,
      'train.grad_clip_norm': 0.0})
  tx = make_optimizer(fresh_cfg.train)
  mesh = make_mesh(fresh_cfg.mesh)
  fresh, _ = state_lib.init_state(fresh_cfg, tx, mesh, fresh_cfg.mesh.rules)
  started = load_warm_starts(fresh_cfg, fresh, mesh)
  for group in ('params', 'router_bias'):
    a, b = _named(before[group]), _named(started[group])
    for k in a:
      np.testing.assert_array_equal(a[k], b[k], err_msg=f'{group} {k}')
  assert started['opt'] is fresh['opt'] and int(started['step']) == 0
  other = resolved(num_devices=jax.device_count(), **{**TOY, 'model.hc_mult': 2,
                                                      'checkpoint.init_from': step_dir})
  with pytest.raises(CheckpointError, match='model.hc_mult'):
    load_warm_starts(other, fresh, mesh)


def test_a_dspark_checkpoint_exports_its_backbone(trained, tmp_path):
  """Export asks the checkpoint's objective where the backbone is: a DSpark stage whose backbone
  was loaded from the toy run exports exactly the toy run's files, and says the drafter is
  left out."""
  from deepseek41.train.warm_start import load_warm_starts
  _, _, workdir, _ = trained
  stage = resolved(num_devices=jax.device_count(), **TOY, **{
      'dspark.stage': 'post_training', 'dspark.num_blocks': 1, 'dspark.block_size': 3,
      'dspark.n_routed_experts': 4, 'dspark.num_experts_per_tok': 2, 'dspark.markov_rank': 8,
      'dspark.backbone_checkpoint': os.path.join(workdir, 'checkpoints', '0')})
  tx, mesh = make_optimizer(stage.train), make_mesh(stage.mesh)
  state, _ = state_lib.init_state(stage, tx, mesh, stage.mesh.rules)
  state = load_warm_starts(stage, state, mesh)
  ckpt = Checkpointer(str(tmp_path / 'stage'), stage.checkpoint)
  ckpt.save(0, state, None, stage.to_dict(),
            state_lib.state_layout(state_lib.abstract_state(stage, tx)))
  ckpt.close()
  notes = []
  hf_convert.export_hf(str(tmp_path / 'stage'), str(tmp_path / 'hf_stage'), dtype='fp32',
                       progress=False, say=notes.append)
  hf_convert.export_hf(workdir, str(tmp_path / 'hf_pre'), dtype='fp32', progress=False,
                       say=_quiet)
  assert any('only its backbone is exported' in n for n in notes)
  names = sorted(os.listdir(tmp_path / 'hf_pre'))
  assert names == sorted(os.listdir(tmp_path / 'hf_stage')) and len(names) > 1
  for name in names:
    assert (tmp_path / 'hf_stage' / name).read_bytes() == \
        (tmp_path / 'hf_pre' / name).read_bytes(), name


def _tile_fp8_reference(w_oi):
  """e4m3 with a power-of-two scale per 32x32 tile, straight from the definition."""
  out = np.empty_like(w_oi, np.float32)
  for i in range(0, w_oi.shape[0], 32):
    for j in range(0, w_oi.shape[1], 32):
      tile = w_oi[i:i + 32, j:j + 32].astype(np.float32)
      scale = np.float32(2.0 ** np.ceil(np.log2(np.abs(tile).max() / 448.0)))
      out[i:i + 32, j:j + 32] = (tile / scale).astype(ml_dtypes.float8_e4m3fn).astype(
          np.float32) * scale
  return out


def test_fp8_fp4_storage_round_trip_is_exact(trained):
  c, run, workdir, root = trained
  hf_convert.export_hf(workdir, str(root / 'hf8'), dtype='fp8', progress=False, say=_quiet)
  reader = safetensors_io.CheckpointReader(str(root / 'hf8'))
  dtypes = {n: reader.ref(n).dtype for n in reader.tensors}
  assert dtypes['model.layers.0.attn.wq_a.weight'] == storage.E4M3
  assert dtypes['model.layers.0.attn.wq_a.weight_scale_inv'] == storage.E8M0
  assert dtypes['model.layers.0.ffn.experts.3.w2.weight'] == np.uint8
  assert dtypes['model.layers.1.engram.embed.weight'] == storage.E4M3
  assert dtypes['model.layers.1.engram.embed.scale'] == storage.E8M0
  assert dtypes['model.layers.0.hc_attn_fn'] == np.float32
  assert dtypes['model.embed.weight'] == ml_dtypes.bfloat16
  cfg = json.loads((root / 'hf8' / 'config.json').read_text())
  assert cfg['quantization_config']['weight_block_size'] == [32, 32]

  hf_convert.import_hf(str(root / 'hf8'), str(root / 'imp8'), base=c, progress=False, say=_quiet)
  orig = _named(_restore(workdir, run)['params'])
  once = _named(_restore(str(root / 'imp8'), run)['params'])
  fq_fp4, fq_fp8 = get_fake_quant('fp4_ue8m0_32'), get_fake_quant('fp8_ue8m0_32')
  for entry in hf_layout.entries(run.model):
    if entry.group != 'params':
      continue
    k, value = entry.ours, orig[entry.ours]
    if entry.storage == 'fp8':
      (hf,) = hf_layout.to_hf(entry, value)
      want = hf_layout.to_ours(entry, [_tile_fp8_reference(hf)], value.shape)
    elif entry.storage == 'fp4':  # blocks of 32 along each expert's input axis
      want = np.asarray(fq_fp4(np.swapaxes(value, 1, 2))).swapaxes(1, 2)
    elif entry.storage == 'engram':
      want = np.asarray(fq_fp8(value))
    elif entry.storage == 'half':
      want = value.astype(ml_dtypes.bfloat16).astype(np.float32)
    else:
      want = value
    np.testing.assert_array_equal(once[k], want, err_msg=k)
  # The stored values are a fixed point: exporting them again gives them back exactly.
  shutil.rmtree(workdir + '_again', ignore_errors=True)
  hf_convert.export_hf(str(root / 'imp8'), str(root / 'hf8b'), dtype='fp8', progress=False,
                       say=_quiet)
  hf_convert.import_hf(str(root / 'hf8b'), str(root / 'imp8b'), base=c, progress=False,
                       say=_quiet)
  twice = _named(_restore(str(root / 'imp8b'), run)['params'])
  for k in once:
    np.testing.assert_array_equal(once[k], twice[k], err_msg=k)


def test_released_config_maps_onto_configs_v41_flash():
  """The released config.json (docs/architecture.md section 2.1) gives our released model; what
  differs is set on purpose (the HF forward) or is not in the HF format (vision, init)."""
  from deepseek41.config import load_config_file, resolve
  from deepseek41.interop import hf_config
  text = dict(
      vocab_size=129280, hidden_size=5120, num_hidden_layers=40, num_attention_heads=64,
      num_key_value_heads=1, head_dim=512, q_lora_rank=1280, qk_rope_head_dim=64,
      rope_theta=10000.0, compress_rope_theta=160000.0, max_position_embeddings=1048576,
      rope_scaling={'rope_type': 'yarn', 'factor': 16, 'beta_fast': 32, 'beta_slow': 1,
                    'original_max_position_embeddings': 65536},
      sliding_window=128, compress_ratios=[0, 0] + [2] * 18 + [1] * 20 + [0, 0, 0],
      kv_source_layer_ids=[2, 8, 14, 20], index_source_layer_ids=[2, 8, 14, 20, 24, 28, 32, 36],
      candidate_source_layer_id=20, candidate_topk_blocks=2048, candidate_block_size=8,
      index_n_heads=32, index_head_dim=128, index_topk=512, o_groups=8, o_lora_rank=1024,
      moe_intermediate_size=2304, n_routed_experts=384, n_shared_experts=1, num_experts_per_tok=6,
      scoring_func='sqrtsoftplus', norm_topk_prob=True, routed_scaling_factor=1.5,
      topk_method='noaux_tc', swiglu_limit=10.0, hc_mult=4, hc_sinkhorn_iters=20, hc_eps=1e-6,
      engram_layer_ids=[1, 14], engram_vocab_size=16000000,
      engram_num_embeddings=[384006168, 384016682], engram_max_ngram_size=4, engram_n_heads=8,
      engram_head_dim=256, engram_pad_id=2, engram_compressed_vocab_size=99092,
      num_nextn_predict_layers=3, dspark_block_size=5, dspark_noise_token_id=128799,
      dspark_target_layer_ids=[37, 38, 39], dspark_markov_rank=256, dspark_n_routed_experts=128,
      dspark_num_experts_per_tok=3, hidden_act='silu', rms_norm_eps=1e-20, initializer_range=0.006,
      bos_token_id=0, eos_token_id=1, use_cache=True, model_type='deepseek_v41_text')
  released = {'architectures': ['DeepseekV41ForCausalLM'], 'model_type': 'deepseek_v41',
              'image_token_id': 129264, 'tie_word_embeddings': False, 'torch_dtype': 'bfloat16',
              'text_config': text, 'vision_config': {'hidden_size': 1024},
              'quantization_config': {'quant_method': 'fp8', 'fmt': 'e4m3',
                                      'weight_block_size': [32, 32], 'scale_fmt': 'ue8m0'}}
  ours = load_config_file(os.path.join(REPO_ROOT, 'configs', 'v41_flash.py'))
  c, _ = hf_convert.build_run_config(released, base=ours)
  imported = resolve(c, backend='cpu', num_devices=64).model
  hf_config.check_engram_rows(imported, text)
  want = resolve(ours, backend='cpu', num_devices=64).model
  differ = {k for k in vars(want) if getattr(want, k) != getattr(imported, k)}
  assert differ == {'q_head_norm', 'vision'}, differ
  bad = {**text, 'engram_num_embeddings': [384006168, 384016683]}
  with pytest.raises(HFConfigError, match='engram_num_embeddings'):
    hf_config.check_engram_rows(imported, bad)


def _rewrite(src, dst, drop=(), replace=None, config_edit=None):
  """A copy of the HF checkpoint `src` with tensors dropped / replaced and config.json edited."""
  os.makedirs(dst)
  reader = safetensors_io.CheckpointReader(src)
  replace = replace or {}
  tensors = [(n, replace.get(n, reader.read(n))) for n in sorted(reader.tensors) if n not in drop]
  tensors += [(n, a) for n, a in replace.items() if n not in reader]
  safetensors_io.write_file(os.path.join(dst, safetensors_io.SINGLE_FILE), tensors)
  cfg = json.loads(open(os.path.join(src, 'config.json')).read())
  if config_edit:
    config_edit(cfg)
  with open(os.path.join(dst, 'config.json'), 'w') as f:
    json.dump(cfg, f)


def test_misfits_fail_naming_the_culprit_and_leave_nothing(trained):
  c, run, workdir, root = trained
  src = str(root / 'hf_src')
  if not os.path.isdir(src):
    hf_convert.export_hf(workdir, src, dtype='fp32', progress=False, say=_quiet)
  wq = 'model.layers.3.attn.wq_b.weight'
  cases = {
      'field': (dict(config_edit=lambda d: d['text_config'].update(mystery_knob=3)),
                "'mystery_knob'"),
      'value': (dict(config_edit=lambda d: d['text_config'].update(scoring_func='softmax')),
                'scoring_func'),
      'missing': (dict(drop=('model.layers.4.ffn.experts.5.w3.weight',)),
                  'model.layers.4.ffn.experts.5.w3.weight'),
      'shape': (dict(replace={wq: np.zeros((8, 32), np.float32)}), wq),
      'extra': (dict(replace={'model.layers.9.attn.wq_a.weight': np.zeros(2, np.float32)}),
                'model.layers.9.attn.wq_a.weight'),
  }
  for name, (edit, culprit) in cases.items():
    bad = str(root / f'bad_{name}')
    _rewrite(src, bad, **edit)
    out = root / f'out_{name}'
    with pytest.raises((ConvertError, HFConfigError)) as err:
      hf_convert.import_hf(bad, str(out), base=c, progress=False, say=_quiet)
    assert culprit in str(err.value), (name, str(err.value))
    assert not out.exists(), name
    assert not [p for p in os.listdir(root) if '.partial-' in p], name
  # The command line reports it with exit status 2.
  proc = subprocess.run([sys.executable, '-m', 'deepseek41.tools.convert', 'import',
                         f'--hf={root / "bad_field"}', f'--workdir={root / "out_cli"}',
                         '--noprogress'], capture_output=True, text=True, timeout=120,
                        env={**os.environ, 'JAX_PLATFORMS': 'cpu'})
  assert proc.returncode == 2 and 'mystery_knob' in proc.stderr, proc.stderr
  assert not (root / 'out_cli').exists()


def test_safetensors_files_round_trip(tmp_path):
  rng = np.random.default_rng(0)
  tensors = [('a.weight', rng.standard_normal((5, 7)).astype(np.float32)),
             ('b', rng.standard_normal((3,)).astype(ml_dtypes.bfloat16)),
             ('c', rng.standard_normal((4, 64)).astype(storage.E4M3)),
             ('d', np.arange(6, dtype=np.uint8).reshape(2, 3)),
             ('e', np.zeros((0, 4), np.float32))]
  safetensors_io.write_checkpoint(str(tmp_path), iter(tensors), shard_bytes=64)
  index = json.loads((tmp_path / safetensors_io.INDEX_FILE).read_text())
  assert len(set(index['weight_map'].values())) > 1  # split into several shards
  got = dict(safetensors_io.iter_checkpoint(str(tmp_path)))
  for name, arr in tensors:
    assert got[name].dtype == arr.dtype and got[name].shape == arr.shape
    np.testing.assert_array_equal(got[name].view(np.uint8), arr.view(np.uint8))


def test_safetensors_interoperate_with_the_reference_library(tmp_path):
  """The reference implementation reads our files and we read its (through torch, for the
  float8 and bfloat16 element types numpy lacks); skipped without the `hf` extra."""
  st = pytest.importorskip('safetensors.torch')
  import torch
  rng = np.random.default_rng(0)
  tensors = [('a.weight', rng.standard_normal((5, 7)).astype(np.float32)),
             ('b', rng.standard_normal((3,)).astype(ml_dtypes.bfloat16)),
             ('c', rng.standard_normal((4, 64)).astype(storage.E4M3)),
             ('d', np.arange(6, dtype=np.uint8).reshape(2, 3))]
  safetensors_io.write_checkpoint(str(tmp_path), iter(tensors), shard_bytes=64)
  index = json.loads((tmp_path / safetensors_io.INDEX_FILE).read_text())
  for name, file in index['weight_map'].items():
    theirs = st.load_file(str(tmp_path / file))[name]
    want = dict(tensors)[name]
    assert tuple(theirs.shape) == want.shape
    raw = theirs.contiguous().view(-1).view(torch.uint8).numpy()
    np.testing.assert_array_equal(raw, want.view(np.uint8).ravel())
  ref = {'x': torch.arange(6, dtype=torch.float32).reshape(2, 3),
         'y': torch.tensor([1.5, -2.0], dtype=torch.bfloat16),
         'z': torch.tensor([0.5, 448.0], dtype=torch.float32).to(torch.float8_e4m3fn)}
  st.save_file(ref, str(tmp_path / 'o.safetensors'))
  ours = safetensors_io.file_tensors(str(tmp_path / 'o.safetensors'))
  np.testing.assert_array_equal(ours['x'].read(), np.arange(6, dtype=np.float32).reshape(2, 3))
  np.testing.assert_array_equal(ours['y'].read().astype(np.float32), [1.5, -2.0])
  np.testing.assert_array_equal(ours['z'].read().astype(np.float32), [0.5, 448.0])


def test_layouts_invert():
  """Every layout kind: HF arrays -> ours -> HF arrays gives them back; a padded Engram table
  gets zero rows past the HF ones."""
  rng = np.random.default_rng(2)
  cases = {'copy': (3, 4), 'linear': (5, 7), 'heads': (6, 2, 3), 'wo_a': (2, 6, 4),
           'experts': (3, 5, 7), 'router_bias': (2, 5), 'table': (8, 4)}
  for kind, shape in cases.items():
    entry = hf_layout.Entry('x', ('a', 'b', 'c')[:1], kind, 'half', rows=5)
    hf = [rng.standard_normal(s).astype(np.float32) for s in hf_layout.hf_shapes(entry, shape)]
    ours = hf_layout.to_ours(entry, hf, shape)
    assert ours.shape == shape, kind
    for a, b in zip(hf_layout.to_hf(entry, ours), hf):
      np.testing.assert_array_equal(a, b, err_msg=kind)
  np.testing.assert_array_equal(ours[5:], 0)  # the table's padding rows
  # wo_a: group g's block of the HF weight is rows g*R .. (g+1)*R, mapping (H/G)*d -> R.
  g, f, r = 2, 6, 4
  w = rng.standard_normal((g * r, f)).astype(np.float32)
  ours = hf_layout.to_ours(hf_layout.Entry('o', ('w',), 'wo_a', 'fp8'), [w], (g, f, r))
  x = rng.standard_normal(f).astype(np.float32)
  np.testing.assert_allclose(x @ ours[1], w[r:] @ x, rtol=1e-6)


def test_storage_codecs():
  rng = np.random.default_rng(1)
  w = rng.standard_normal((100, 70)).astype(np.float32)  # sides not multiples of the tile
  q, s = storage.encode_fp8_blocks(w, 32)
  assert q.dtype == storage.E4M3 and s.shape == (4, 3)
  assert hf_convert._tile('w', q.shape, s.shape, 32) == 32
  with pytest.raises(ConvertError, match='weight_block_size'):  # 25 .. 33 give 4 x 3 too
    hf_convert._tile('w', q.shape, s.shape, None)
  assert hf_convert._tile('w', (128, 64), (4, 2), None) == 32
  once = storage.decode_fp8_blocks(q, s, 32)
  np.testing.assert_array_equal(once[:32, :32], _tile_fp8_reference(w[:32, :32]))
  again = storage.decode_fp8_blocks(*storage.encode_fp8_blocks(once, 32), 32)
  np.testing.assert_array_equal(again, once)
  codes = np.arange(16, dtype=np.uint8).view(storage.E2M1)
  packed = storage.pack_fp4(codes[None, :])
  assert packed.shape == (1, 8) and packed[0, 0] == 0x10  # element 0 low, element 1 high
  np.testing.assert_array_equal(storage.unpack_fp4(packed)[0].view(np.uint8), np.arange(16))
  w = np.random.default_rng(1).standard_normal((4, 64)).astype(np.float32)
  w[0, :32] = 0.0  # an all-zero block stays zero
  once = storage.decode_fp4_experts(*storage.encode_fp4_experts(w))
  assert np.all(once[0, :32] == 0)
  np.testing.assert_array_equal(storage.decode_fp4_experts(*storage.encode_fp4_experts(once)),
                                once)


_MEMORY_SCRIPT = textwrap.dedent('''
    import json, sys, tracemalloc
    import numpy as np
    sys.path.insert(0, sys.argv[3])
    from tests.helpers import resolved
    from deepseek41.interop import hf_convert, hf_layout, safetensors_io
    from deepseek41.train import state as state_lib
    from deepseek41.train.optimizer import make_optimizer
    run = resolved(**json.loads(sys.argv[2]))
    abstract = state_lib.abstract_state(run, make_optimizer(run.train))
    biases = state_lib.named_leaves(abstract['router_bias'])
    targets = {**state_lib.named_leaves(abstract['params']),
               **{'router_bias:' + k: v for k, v in biases.items()}}
    reader = safetensors_io.CheckpointReader(sys.argv[1])

    def status(key):
      for line in open('/proc/self/status'):
        if line.startswith(key):
          return int(line.split()[1]) * 1024
    with open('/proc/self/clear_refs', 'w') as f:
      f.write('5')  # resets the peak resident size (VmHWM) to the current one
    base = status('VmRSS:')
    tracemalloc.start()
    largest = n = 0
    for entry, value in hf_convert.imported_arrays(reader, run.model, targets):
      largest, n = max(largest, value.nbytes), n + value.nbytes
      del value
    traced = tracemalloc.get_traced_memory()[1]
    rss = status('VmHWM:') - base
    # Export's writer: the same tensors appended to 64 MiB shards, never held per shard.
    tracemalloc.reset_peak()
    writer = safetensors_io.ShardedWriter(sys.argv[4], shard_bytes=64 << 20)
    for entry, value in hf_convert.imported_arrays(reader, run.model, targets):
      for name, arr in zip(entry.hf, hf_layout.to_hf(entry, value)):
        writer.add(name, arr)
      del value
    writer.close()
    print(json.dumps({'rss_growth': rss, 'traced_peak': traced, 'largest': largest, 'total': n,
                      'write_traced_peak': tracemalloc.get_traced_memory()[1]}))
''')


def test_import_streams_one_tensor_at_a_time(tmp_path):
  # ~300 MiB of fp32 weights in 12 layers; the largest tensor (a stacked expert weight) is 8 MiB.
  big = {**TOY, 'model.num_layers': 12, 'model.compress_ratios': (0, 2, 2) + (1,) * 9,
         'model.d_model': 256, 'model.n_routed_experts': 32, 'model.moe_intermediate_size': 256,
         'model.engram_layer_ids': (1,)}
  run = resolved(**big)
  abstract = state_lib.abstract_state(run, make_optimizer(run.train))
  leaves = state_lib.named_leaves(abstract['params'])
  leaves.update({e.ours: v for e in hf_layout.entries(run.model) if e.group == 'router_bias'
                 for v in [state_lib.named_leaves(abstract['router_bias'])[e.ours]]})
  writer = safetensors_io.ShardedWriter(str(tmp_path), shard_bytes=64 << 20)
  for entry in hf_layout.entries(run.model):
    for name, shape in zip(entry.hf, hf_layout.hf_shapes(entry, leaves[entry.ours].shape)):
      writer.add(name, np.full(shape, 0.5, np.float32))
  writer.close()
  out = tmp_path / 'written'
  out.mkdir()
  try:
    proc = subprocess.run([sys.executable, '-c', _MEMORY_SCRIPT, str(tmp_path), json.dumps(big),
                           REPO_ROOT, str(out)], capture_output=True, text=True,
                          timeout=300, env={**os.environ, 'JAX_PLATFORMS': 'cpu'})
    shards = len(list(out.glob('model-*.safetensors')))
  finally:  # 600 MB of files: not kept with pytest's temporary directories
    shutil.rmtree(tmp_path, ignore_errors=True)
  assert proc.returncode == 0, proc.stderr[-2000:]
  m = json.loads(proc.stdout.strip().splitlines()[-1])
  assert m['total'] > 25 * m['largest'], m
  # Reading, laying out and casting one tensor takes a few copies of it, never the model: both
  # the allocations numpy makes and the process's peak resident size (file pages included).
  assert m['traced_peak'] < 3 * m['largest'], m
  assert m['rss_growth'] < 4 * m['largest'], m
  assert m['write_traced_peak'] < 4 * m['largest'], m  # reading it again included
  assert shards > 3


def test_training_resumes_an_import_and_starts_from_one(trained, tmp_path):
  """`deepseek41.train` on the import's own work directory resumes its step 0 (no data state:
  the input starts at its beginning); a new run with checkpoint.init_from starts from its
  weights with a fresh optimizer."""
  from deepseek41.config import load_config_file
  from deepseek41.train.trainer import train
  c, run, workdir, root = trained
  hf_convert.export_hf(workdir, str(tmp_path / 'hf'), dtype='fp32', progress=False, say=_quiet)
  imported = str(tmp_path / 'imported')
  step_dir = hf_convert.import_hf(str(tmp_path / 'hf'), imported, base=c, progress=False,
                                  say=_quiet)
  cfg = load_config_file(os.path.join(imported, 'config.py'))
  cfg.train.steps, cfg.checkpoint.every_steps = 1, 1
  cfg.train.compilation_cache_dir = c.train.compilation_cache_dir
  assert train(cfg, imported).step == 1
  cfg.checkpoint.init_from = step_dir
  result = train(cfg, str(tmp_path / 'new'))
  assert result.step == 1
  with pytest.raises(Exception, match='init_from'):
    cfg.checkpoint.init_from = str(tmp_path / 'nowhere')
    train(cfg, str(tmp_path / 'new2'))
