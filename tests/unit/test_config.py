"""Config files build, validation names the culprit key, the role table follows
docs/architecture.md section 1, and the declarations are the one schema."""

import dataclasses
import glob
import os

import jax
import pytest

from deepseek41.config import (FULL, REINDEX, REUSE, SECTIONS, SWA, ConfigError, ModelConfig,
                               base_config, layer_roles, load_config_file, parse_sources,
                               remats_layer, resolve)
from deepseek41.config.command_line import check_command_line
from deepseek41.train.state import abstract_state, count_params
from deepseek41.train.optimizer import make_optimizer
from tests.helpers import REPO_ROOT, small_config

ROOT = REPO_ROOT
CONFIGS = sorted(glob.glob(os.path.join(ROOT, 'configs', '*.py')))
# Exact parameter counts of the shipped configs: a change to one is a change to that model
# (v41_flash: the released backbone + padded Engram tables + the ViT, itemised below).
# The DSpark stages' trainable parameters are the drafter's (the backbone is `frozen`).
CONFIG_PARAMS = {'ablation_1b.py': 1_261_912_776, 'ablation_3b.py': 3_046_162_120,
                 'ablation_longctx.py': 164_971_760, 'tiny.py': 4_673_136,
                 'tiny_multimodal.py': 5_243_120, 'v41_flash.py': 748_981_418_096,
                 'ablation_1b_dspark.py': 157_331_730, 'tiny_dspark.py': 1_150_228}
FROZEN_BACKBONE = {'ablation_1b_dspark.py': 'ablation_1b.py', 'tiny_dspark.py': 'tiny.py'}


@pytest.mark.parametrize('optimizer', ['as_shipped', 'adamw', 'muon_hybrid'])
@pytest.mark.parametrize('path', CONFIGS, ids=os.path.basename)
def test_every_config_builds(path, optimizer):
  config = load_config_file(path)
  if optimizer != 'as_shipped':
    config.train.optimizer = optimizer
  sharded = any(config.mesh[a] > 1 for a in ('fsdp', 'expert', 'tensor', 'context'))
  cfg = resolve(config, num_devices=8 if sharded else 1, backend='cpu')
  abstract = abstract_state(cfg, make_optimizer(cfg.train))  # jax.eval_shape: no arrays
  assert count_params(abstract['params']) == CONFIG_PARAMS[os.path.basename(path)]
  if os.path.basename(path) in FROZEN_BACKBONE:
    assert count_params(abstract['frozen']) == \
        CONFIG_PARAMS[FROZEN_BACKBONE[os.path.basename(path)]]
  assert all(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(abstract))


def test_tiny_roles_match_the_reference_toy():
  cfg = resolve(load_config_file(os.path.join(ROOT, 'configs', 'tiny.py')), backend='cpu',
                num_devices=1)
  roles = layer_roles(cfg.model)
  assert [r.mode for r in roles] == [SWA, SWA, FULL, REUSE, FULL, REUSE, REINDEX, REUSE]
  assert [r.kv_source for r in roles] == [-1, -1, 2, 2, 4, 4, 4, 4]
  assert [r.index_source for r in roles] == [-1, -1, 2, 2, 4, 4, 6, 6]
  assert [r.publishes_candidates for r in roles].index(True) == 4
  assert [r.uses_candidates for r in roles] == [False] * 6 + [True, False]
  assert [r.engram for r in roles] == [False, True, False, True] + [False] * 4
  assert [r.rope for r in roles] == ['main'] * 2 + ['compress'] * 6
  assert [r.block for r in roles] == ['encoder'] * 4 + ['decoder'] * 4


@pytest.mark.parametrize('key, value, culprit', [
    ('model.o_groups', 3, 'model.o_groups'),
    ('model.compress_ratios', (0, 0, 1, 1), 'model.kv_source_layer_ids'),
    ('model.kv_source_layer_ids', (0, 2), 'model.kv_source_layer_ids'),
    ('model.index_topk', 64, 'model.index_topk'),
    ('model.num_experts_per_tok', 9, 'model.num_experts_per_tok'),
    ('model.moe_backend', 'fast', 'model.moe_backend'),
    ('model.rope_head_dim', 7, 'model.rope_head_dim'),
    ('train.grad_accum_steps', 3, 'train.grad_accum_steps'),
    ('train.schedule', 'linear', 'train.schedule'),
    ('mesh.fsdp', 3, 'mesh'),
    ('data.sources', 'a:-1', 'data.sources'),
    ('log.profile_steps', 0, 'log.profile_steps'),
    ('train.vision_lr_multiplier', 0.0, 'train.vision_lr_multiplier'),
    ('log.profile_start_step', -1, 'log.profile_start_step'),
    ('model.index_causal_groups', 0, 'model.index_causal_groups'),
    ('model.sparse_dkv_tile', 3, 'model.sparse_dkv_tile'),
    ('model.sparse_dkv_tile', -4, 'model.sparse_dkv_tile'),
    ('model.decode_union_rows', -1, 'model.decode_union_rows'),
    ('model.moe_small_call_block_m', 24, 'model.moe_small_call_block_m'),
    ('model.moe_small_call_block_m', 256, 'model.moe_small_call_block_m'),
])
def test_inconsistent_values_name_the_key(key, value, culprit):
  with pytest.raises(ConfigError, match=culprit.replace('.', r'\.')):
    resolve(small_config(**{key: value}), num_devices=8, backend='cpu')


@pytest.mark.parametrize('layers', [-1, 5])   # the small config has 4 layers
def test_remat_layers_within_the_model(layers):
  with pytest.raises(ConfigError, match=r'train\.remat_layers'):
    resolve(small_config(**{'train.remat': 'block', 'train.remat_layers': layers}),
            num_devices=8, backend='cpu')
  ok = resolve(small_config(**{'train.remat': 'block', 'train.remat_layers': 4}),
               num_devices=8, backend='cpu')
  assert ok.train.remat_layers == 4
  # remat 'none' remats nothing, whatever the count (scripts switch remat off over a config
  # that sets one)
  off = resolve(small_config(**{'train.remat_layers': 2}), num_devices=8, backend='cpu').train
  assert not any(remats_layer(off.remat, off.remat_layers, layer) for layer in range(4))


@pytest.mark.parametrize('key, value', [
    ('dspark.target_layer_ids', (1, 9)), ('dspark.num_experts_per_tok', 5),
    ('dspark.noise_token_id', 10_000), ('dspark.n_routed_experts', 6),
    ('dspark.slot_decay', 0.0), ('train.grad_accum_steps', 2)])
def test_dspark_values_name_the_key(key, value):
  overrides = {'dspark.stage': 'frozen', 'dspark.n_routed_experts': 4, 'mesh.data': -1,
               'mesh.expert': 8 if key == 'dspark.n_routed_experts' else 1,
               'train.batch_size': 16, key: value}
  with pytest.raises(ConfigError, match=key.replace('.', r'\.')):
    resolve(small_config(**overrides), num_devices=8, backend='cpu')


def test_unknown_keys_are_rejected_with_their_name():
  c = small_config()
  c.model.num_layer = 3
  with pytest.raises(ConfigError, match=r"unknown config key 'model.num_layer'.*model.num_layers"):
    resolve(c, num_devices=1, backend='cpu')
  with pytest.raises(ConfigError, match='model.nope'):
    load_config_file(os.path.join(ROOT, 'configs', 'tiny.py'), {'model.nope': 1})


def test_batch_must_split_over_devices():
  with pytest.raises(ConfigError, match='train.batch_size'):
    resolve(small_config(**{'train.batch_size': 4, 'mesh.data': -1}), num_devices=8,
            backend='cpu')


def test_auto_choices_resolve_by_backend():
  gpu = resolve(base_config(), num_devices=1, backend='gpu').model
  cpu = resolve(base_config(), num_devices=1, backend='cpu').model
  tpu = resolve(base_config(), num_devices=1, backend='tpu').model
  assert (gpu.compute_dtype, gpu.moe_backend) == ('bfloat16', 'grouped')
  assert (cpu.compute_dtype, cpu.moe_backend) == ('float32', 'reference')  # dropless everywhere
  assert tpu.moe_backend == 'ragged_dot'


def test_cli_rejects_unknown_override_and_missing_config(tmp_path):
  """The train CLI's check before absl parses anything (tests/system/test_cli.py runs it)."""
  argv = ['ds41-train', f'--config={ROOT}/configs/tiny.py', f'--workdir={tmp_path}']
  assert check_command_line(argv) is None
  problem = check_command_line(argv + ['--config.model.no_such_key=1'])
  assert "unknown config key 'model.no_such_key'" in problem and 'model has:' in problem
  assert check_command_line(['ds41-train', '--config=configs/nope.py']) == \
      "--config file 'configs/nope.py' does not exist"


def test_released_config_parameter_accounting():
  """The model built from configs/v41_flash.py holds the released backbone, part by part
  (docs/architecture.md section 6)."""
  cfg = resolve(load_config_file(os.path.join(ROOT, 'configs', 'v41_flash.py')), backend='cpu',
                num_devices=8)
  abstract = abstract_state(cfg, make_optimizer(cfg.train))
  params, blocks = abstract['params'], abstract['params']['blocks']
  n = count_params
  # Attention of an SWA-only layer: 5120x1280 + 1280 (q_a, norm) + 1280x32768 (q_b) + 5120x512 +
  # 512 (kv, norm) + 64 (sink) + 8x4096x1024 (o_a) + 8192x5120 (o_b).
  assert n(blocks[0]['attn']) == 126_617_408
  # KV + index sources add a compressor (ratio 2: 5_243_392, ratio 1: 2_621_952), index queries
  # (5_406_720) and index keys (65_664); an index-only source (Reindex) adds the queries alone.
  assert n(blocks[2]['attn']) == 126_617_408 + 5_243_392 + 5_406_720 + 65_664
  assert n(blocks[20]['attn']) == 126_617_408 + 2_621_952 + 5_406_720 + 65_664
  assert n(blocks[24]['attn']) == 126_617_408 + 5_406_720
  assert n(blocks[21]['attn']) == 126_617_408
  # MoE: 384 routed + 1 shared SwiGLU experts of 5120 x 2304, and the 5120 x 384 router.
  assert all(n(blocks[l]['moe']) == 13_626_900_480 for l in range(40))
  # mHC: two sites per layer of 24 x (4 x 5120) + 24 + 3.
  assert all(n(blocks[l]['attn_site']) == n(blocks[l]['ffn_site']) == 491_547 for l in range(40))
  # Engram before layers 1 and 14: the two projections, and tables whose released row counts
  # (384_006_168 and 384_016_682) are padded to multiples of 4096 (engram_table_row_multiple).
  tables = [blocks[l]['engram']['table'].get_value().shape for l in (1, 14)]
  assert tables == [(384_008_192, 256), (384_020_480, 256)]
  assert n(blocks[1]['engram']) - n(blocks[1]['engram']['table']) == 157_327_360
  # The backbone as released, without the tables (correction biases are state here, tensors in
  # the release).
  table_params = sum(n(blocks[l]['engram']['table']) for l in (1, 14))
  biases = n(abstract['router_bias'])
  assert biases == 40 * 2 * 384
  assert n(params) - n(params['vision']) - table_params + biases == 551_880_835_184


def test_flop_accounting_counts_the_csa2_work():
  from deepseek41.train.flops import active_matmul_params, flops_per_token
  tiny = os.path.join(ROOT, 'configs', 'tiny.py')
  off = resolve(load_config_file(tiny, {'model.attention_variant': 'window'}), num_devices=1,
                backend='cpu').model
  on = resolve(load_config_file(tiny), num_devices=1, backend='cpu').model
  # tiny: r=2 compressor at 2 (wkv + wgate 128x64 each; W_k 64x32 per 2 tokens), r=1 at 4
  # (wkv 128x64; W_k 64x32), index queries at 2, 4, 6 (W_qb 64x4x32, W_w 128x4)
  extra = 2 * 128 * 64 + 64 * 32 // 2 + 128 * 64 + 64 * 32 + 3 * (64 * 4 * 32 + 128 * 4)
  assert active_matmul_params(on) - active_matmul_params(off) == extra
  assert flops_per_token(on, 128).total > flops_per_token(off, 128).total + 6 * extra
  assert 'selected' in flops_per_token(on, 128).formula


# ---------------------------------------------------------------------------------------------
# One declaration per key.


def test_the_section_dataclasses_are_the_schema():
  """base_config() holds exactly the declared fields (only derived ones are not keys), and
  to_dict() (stored in checkpoints) one entry per field."""
  base = base_config()
  run = resolve(base, num_devices=1, backend='cpu').to_dict()
  assert sorted(base.keys()) == sorted(SECTIONS) == sorted(run)
  for name, cls in SECTIONS.items():
    fields = {f.name for f in dataclasses.fields(cls)}
    derived = {'images', 'tasks'} if name == 'data' else set()
    assert fields - derived == set(base[name].keys())
    assert set(run[name]) == fields


def test_values_take_their_declared_types():
  c = small_config(**{'model.compress_ratios': [0, 2, 1, 1], 'train.lr': 1})
  cfg = resolve(c, num_devices=1, backend='cpu')
  assert cfg.model.compress_ratios == (0, 2, 1, 1)
  assert type(cfg.train.lr) is float
  assert cfg.mesh.rules[0] == ('batch', ('data', 'fsdp', 'expert'))
  assert cfg.data.sources == () and cfg.data.images is None
  c = small_config()
  del c.model['d_model']  # past ConfigDict's type lock, as a config built by hand could be
  c.model.d_model = 'wide'
  with pytest.raises(ConfigError, match="model.d_model: must be int, got 'wide'"):
    resolve(c, num_devices=1, backend='cpu')


@pytest.mark.parametrize('backend', ['cpu', 'gpu', 'tpu'])
def test_no_auto_choice_survives_resolution(backend):
  model = resolve(base_config(), num_devices=1, backend=backend).model
  assert 'auto' not in dataclasses.asdict(model).values()
  assert model.index_impl == ('fused' if backend == 'gpu' else 'reference')
  assert model.selected_scores_impl == model.index_impl  # base_config's 16 x 32 indexer
  assert model.vision_attention_impl == ('reference' if backend == 'cpu' else 'fused')
  gpu = backend == 'gpu'
  assert model.attention_impl == 'chunked'  # base_config's 4 heads: the window kernel needs 16
  assert model.sparse_impl == ('fused' if gpu else 'gathered')  # any heads: the kernel pads
  assert model.select_impl == ('threshold' if gpu else 'top_k')
  assert model.mhc_impl == ('fused' if gpu else 'reference')


@pytest.mark.parametrize('override,want', [({}, 'fused'), ({'residual': 'plain'}, 'reference'),
                                           ({'hc_mult': 3}, 'reference'),
                                           ({'d_model': 72, 'num_heads': 4}, 'reference')])
def test_auto_picks_the_fused_mhc_only_where_it_tiles(override, want):
  c = base_config()
  c.model.update(override)
  assert resolve(c, num_devices=1, backend='gpu').model.mhc_impl == want


@pytest.mark.parametrize('key,value', [('sparse_impl', 'fused'), ('attention_impl', 'fused'),
                                       ('select_impl', 'threshold'), ('mhc_impl', 'fused')])
def test_gpu_kernels_are_refused_off_the_gpu(key, value):
  c = base_config()
  c.model[key] = value
  with pytest.raises(ConfigError, match=f'model.{key}'):
    resolve(c, num_devices=1, backend='cpu')


@pytest.mark.parametrize('backend', ['cpu', 'gpu', 'tpu'])
def test_auto_picks_the_window_kernel_on_the_gpu_where_it_tiles(backend):
  c = base_config()
  c.model.num_heads, c.model.head_dim = 16, 32
  model = resolve(c, num_devices=1, backend=backend).model
  assert model.attention_impl == ('fused' if backend == 'gpu' else 'chunked')


@pytest.mark.parametrize('heads,head_dim,backend,want', [
    (16, 512, 'gpu', 'mosaic'), (64, 512, 'gpu', 'mosaic'),  # the 1B and V4.1 shapes
    (16, 64, 'gpu', 'triton'),    # half a 128-column tile per warpgroup
    (128, 128, 'gpu', 'triton'),  # more heads than the 64-row tile
    (16, 512, 'cpu', 'triton')])  # no fused window kernel there
def test_auto_runs_the_mosaic_window_forward_where_it_takes_the_shapes(heads, head_dim,
                                                                       backend, want):
  c = base_config()
  c.model.num_heads, c.model.head_dim = heads, head_dim
  assert resolve(c, num_devices=1, backend=backend).model.window_forward == want


@pytest.mark.parametrize('override,match', [
    ({'attention_impl': 'chunked'}, "needs model.attention_impl='fused'"),
    ({'num_heads': 16, 'head_dim': 64, 'attention_impl': 'fused'}, 'multiple of 128')])
def test_the_mosaic_window_forward_is_refused_where_it_cannot_run(override, match):
  c = base_config()
  c.model.update(override, window_forward='mosaic')
  with pytest.raises(ConfigError, match=f'model.window_forward.*{match}'):
    resolve(c, num_devices=1, backend='gpu')


def test_the_window_kernel_refuses_shapes_it_cannot_tile():
  c = base_config()
  c.model.attention_impl = 'fused'  # base_config has 4 heads
  with pytest.raises(ConfigError, match='model.attention_impl.*power-of-two'):
    resolve(c, num_devices=1, backend='gpu')


def test_model_config_has_no_roles_shortcut():
  """layer_roles(model) is the one way to the role table."""
  assert not hasattr(ModelConfig, 'roles')


# ---------------------------------------------------------------------------------------------
# Knobs that would do nothing, and bad data sources.


def test_context_split_must_divide_the_sequence_and_hold_the_window_halo():
  assert resolve(small_config(**{'mesh.data': 4, 'mesh.context': 2}), num_devices=8,
                 backend='cpu').mesh.context == 2
  with pytest.raises(ConfigError, match=r'mesh\.context: 5 sequence shards cannot split'):
    resolve(small_config(**{'mesh.data': 1, 'mesh.context': 5}), num_devices=5, backend='cpu')
  with pytest.raises(ConfigError, match=r'mesh\.context: .* window halo'):
    resolve(small_config(**{'mesh.data': 1, 'mesh.context': 8, 'model.sliding_window': 8}),
            num_devices=8, backend='cpu')


def test_experts_must_split_evenly_over_expert_shards():
  with pytest.raises(ConfigError, match=r'mesh\.expert: 3 expert shards cannot split'):
    resolve(small_config(**{'mesh.data': 1, 'mesh.expert': 3, 'train.batch_size': 6}),
            num_devices=3, backend='cpu')


@pytest.mark.parametrize('spec, message', [
    ('good:abc', r"data\.sources: the weight of entry 'good:abc' is 'abc', not a number"),
    ('a:0', r"data\.sources: the weight of entry 'a:0' must be a number > 0"),
    ('a:-1', r"data\.sources: the weight of entry 'a:-1' must be a number > 0"),
    ('a:nan', r"data\.sources: the weight of entry 'a:nan' must be a number > 0"),
    ('a:inf', r"data\.sources: the weight of entry 'a:inf' must be a number > 0"),
    (':0.5', r"data\.sources: entry ':0.5' has a weight but no path"),
])
def test_bad_source_weights_name_the_entry(spec, message):
  with pytest.raises(ConfigError, match=message):
    resolve(small_config(**{'data.sources': spec}), num_devices=1, backend='cpu')


def test_source_entries_parse_with_their_weights(tmp_path):
  colon = tmp_path / 'run:2'
  colon.mkdir()
  assert parse_sources('default:0.3, /data/a:0.7,/data/b,,') == \
      (('default', 0.3), ('/data/a', 0.7), ('/data/b', 1.0))
  assert parse_sources('gs://bucket/data') == (('gs://bucket/data', 1.0),)
  assert parse_sources(f'{colon},{colon}:2') == ((str(colon), 1.0), (str(colon), 2.0))


def test_a_file_is_not_a_text_source(tmp_path):
  path = tmp_path / 'corpus.txt'
  path.write_text('text')
  with pytest.raises(ConfigError, match=rf"data\.sources: entry '{path}' is a file"):
    resolve(small_config(**{'data.sources': f'{path}:0.5'}), num_devices=1, backend='cpu')


def test_image_sources_may_be_jsonl_files_only(tmp_path):
  jsonl, txt = tmp_path / 'web.jsonl', tmp_path / 'web.txt'
  jsonl.write_text('{}\n')
  txt.write_text('{}\n')
  vision = {'model.vision': True}
  cfg = resolve(small_config(**vision, **{'data.image_sources': f'shapes:0.5,{jsonl}'}),
                num_devices=1, backend='cpu')
  assert cfg.data.image_sources == (('shapes', 0.5), (str(jsonl), 1.0))
  with pytest.raises(ConfigError, match=rf"data\.image_sources: entry '{txt}' is a file but not"):
    resolve(small_config(**vision, **{'data.image_sources': str(txt)}), num_devices=1,
            backend='cpu')


def test_synthetic_data_cannot_feed_a_compressed_engram_vocabulary():
  c = small_config(**{'model.engram': True, 'model.engram_compressed_vocab_size': 50})
  with pytest.raises(ConfigError, match=r'model\.engram_compressed_vocab_size: synthetic data'):
    resolve(c, num_devices=1, backend='cpu')


@pytest.mark.parametrize('key, value, message', [
    ('model.expert_buffer_factor', -1.0, r'model\.expert_buffer_factor: must be >= 0'),
    ('data.streams', -2, r'data\.streams: must be >= 0'),
    ('model.expert_exchange', 'nccl', r'model\.expert_exchange'),
    ('model.grouped_wgrad', 'cutlass', r'model\.grouped_wgrad'),
])
def test_scale_out_keys_are_checked(key, value, message):
  with pytest.raises(ConfigError, match=message):
    resolve(small_config(**{key: value}), num_devices=1, backend='cpu')


def test_expert_exchange_auto_and_buffer_bound():
  """auto: ragged on the TPU, allgather elsewhere, whether or not a buffer factor bounds what a
  shard computes (every exchange takes the bound)."""
  def exchange(backend, **kw):
    return resolve(small_config(**kw), num_devices=1, backend=backend).model.expert_exchange
  assert [exchange(b) for b in ('gpu', 'cpu', 'tpu')] == ['allgather', 'allgather', 'ragged']
  bounded = {'model.expert_buffer_factor': 2.0}
  assert [exchange(b, **bounded) for b in ('gpu', 'tpu')] == ['allgather', 'ragged']
  assert exchange('gpu', **bounded, **{'model.expert_exchange': 'padded'}) == 'padded'
