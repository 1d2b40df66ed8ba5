"""`config.json` of the HF `deepseek_v41` format <-> our model config (docs/hf_interop.md,
"Config fields").

Import reads every field: it is mapped to a model key, checked against the one value our model
implements, or listed as bookkeeping with no effect on the weights or the math. Any other field
stops the import naming it. Where the HF implementation computes differently from our defaults,
the import sets our switch to match (`EQUIVALENCE`) and says so.
"""

from __future__ import annotations

from typing import Any

from deepseek41.config import ModelConfig
from deepseek41.model.engram import layer_addresses


class HFConfigError(ValueError):
  """config.json does not fit our model; the message names the field."""


# HF field -> our model key, copied as they are.
DIRECT = {
    'vocab_size': 'vocab_size', 'hidden_size': 'd_model', 'num_hidden_layers': 'num_layers',
    'num_attention_heads': 'num_heads', 'head_dim': 'head_dim',
    'qk_rope_head_dim': 'rope_head_dim', 'q_lora_rank': 'q_lora_rank', 'o_groups': 'o_groups',
    'o_lora_rank': 'o_lora_rank', 'sliding_window': 'sliding_window',
    'rope_theta': 'rope_theta', 'compress_rope_theta': 'compress_rope_theta',
    'index_n_heads': 'index_n_heads', 'index_head_dim': 'index_head_dim',
    'index_topk': 'index_topk', 'candidate_topk_blocks': 'candidate_topk_blocks',
    'candidate_block_size': 'candidate_block_size',
    'moe_intermediate_size': 'moe_intermediate_size',
    'n_routed_experts': 'n_routed_experts', 'num_experts_per_tok': 'num_experts_per_tok',
    'routed_scaling_factor': 'route_scale', 'swiglu_limit': 'swiglu_limit', 'hc_mult': 'hc_mult',
    'hc_sinkhorn_iters': 'hc_sinkhorn_iters', 'hc_eps': 'hc_eps', 'rms_norm_eps': 'rms_norm_eps',
    'engram_vocab_size': 'engram_vocab_start', 'engram_max_ngram_size': 'engram_max_ngram',
    'engram_n_heads': 'engram_n_heads', 'engram_head_dim': 'engram_head_dim',
    'engram_pad_id': 'engram_pad_token_id',
    'engram_compressed_vocab_size': 'engram_compressed_vocab_size',
    'initializer_range': 'init_std',
}
# HF field -> the one value our model implements.
FIXED = {
    'num_key_value_heads': 1, 'attention_bias': False, 'attention_dropout': 0.0,
    'scoring_func': 'sqrtsoftplus', 'gate_temp': 1.0, 'norm_topk_prob': True,
    'topk_method': 'noaux_tc', 'hidden_act': 'silu', 'tie_word_embeddings': False,
    'n_shared_experts': 1, 'router_jitter_noise': 0.0,
}
# The DSpark fields -> our `dspark` section (the drafter's weights are not in the HF format).
DSPARK = {
    'num_nextn_predict_layers': 'num_blocks', 'dspark_block_size': 'block_size',
    'dspark_noise_token_id': 'noise_token_id', 'dspark_target_layer_ids': 'target_layer_ids',
    'dspark_markov_rank': 'markov_rank', 'dspark_n_routed_experts': 'n_routed_experts',
    'dspark_num_experts_per_tok': 'num_experts_per_tok',
}
# Fields with no effect on the weights or the forward pass: inference caching, generation
# tokens, training-loss knobs of the HF trainer, and HF's own bookkeeping.
BOOKKEEPING = frozenset({
    'model_type', 'architectures', 'transformers_version', 'torch_dtype', 'dtype', 'use_cache',
    'max_position_embeddings', 'pad_token_id', 'bos_token_id', 'eos_token_id',
    'output_router_logits', 'router_aux_loss_coef', 'layer_types', '_name_or_path',
    'return_dict', 'output_hidden_states', 'output_attentions', 'chunk_size_feed_forward',
    'is_encoder_decoder', 'id2label', 'label2id', 'problem_type', 'tokenizer_class',
    'torchscript', 'use_bfloat16', 'pruned_heads', 'tf_legacy_loss', 'add_cross_attention',
    'cross_attention_hidden_size', 'task_specific_params', 'finetuning_task', 'prefix',
    'sep_token_id', 'decoder_start_token_id', 'output_scores', 'return_dict_in_generate',
    '_attn_implementation_autoset', '_commit_hash', 'base_model_tp_plan', 'base_model_pp_plan',
})
# Our switches the HF implementation fixes: set on import, with the reason printed.
EQUIVALENCE = {
    'q_head_norm': (False, 'the HF implementation has no per-head query re-normalisation '
                           '(docs/architecture.md 3.3, section 8 item 1)'),
    'residual': ('mhc_single_pass', 'single-pass mHC is the HF order'),
    'attention_variant': ('csa2', 'every ratio > 0 layer runs the compressed sparse branch'),
    'kv_quant': ('fp4_e4m3_16', 'HF fake-quantizes the compressed KV (FP4, e4m3 scale per 16)'),
    'index_quant': ('fp4_ue8m0_32', 'HF fake-quantizes indexer q and k (FP4, ue8m0 per 32)'),
    'swa_quant': ('fp8_ue8m0_32', 'HF fake-quantizes the window KV (FP8, ue8m0 per 32)'),
}
_QUANT_BLOCK = {'kv_quant': ('head_dim', 16), 'index_quant': ('index_head_dim', 32),
                'swa_quant': ('head_dim', 32)}


def text_config(config: dict) -> tuple[dict, dict]:
  """(text fields, top-level fields) of a composite (`text_config`) or flat config.json."""
  if 'text_config' in config:
    top = {k: v for k, v in config.items() if k != 'text_config'}
    return dict(config['text_config'] or {}), top
  return dict(config), {}


def _ratios(text: dict, n: int) -> tuple[int, ...]:
  ratios = list(text.get('compress_ratios') or [])
  if len(ratios) < n:
    raise HFConfigError(f'config.json compress_ratios has {len(ratios)} entries, fewer than '
                        f'num_hidden_layers={n}')
  extra = ratios[n:]
  if any(extra):
    raise HFConfigError(f'config.json compress_ratios: the entries past num_hidden_layers (the '
                        f'DSpark blocks) must be 0, got {extra}')
  return tuple(int(r) for r in ratios[:n])


def _yarn(text: dict, out: dict) -> None:
  scaling = text.get('rope_scaling') or {}
  params = text.get('rope_parameters') or {}
  compress = params.get('compress') if isinstance(params.get('compress'), dict) else None
  source = scaling or compress or {}
  kind = source.get('rope_type', source.get('type', 'default'))
  if kind not in ('yarn', 'default'):
    raise HFConfigError(f'config.json rope_scaling.rope_type={kind!r}: only yarn (or none) on '
                        'the compressed RoPE is supported')
  main = params.get('main')
  if isinstance(main, dict) and main.get('rope_type', 'default') != 'default':
    raise HFConfigError('config.json rope_parameters.main: the window RoPE must be unscaled')
  if kind == 'default':
    out['yarn_factor'] = 1.0
    return
  if source.get('attention_factor', 1.0) != 1.0 or source.get('mscale', 1.0) not in (1.0, 0, None):
    raise HFConfigError('config.json rope_scaling: YaRN attention scaling (attention_factor / '
                        'mscale) must be 1; the release applies none')
  if not source.get('truncate', True):
    raise HFConfigError('config.json rope_scaling.truncate=false is not supported')
  out['yarn_factor'] = float(source['factor'])
  out['yarn_original_max_position'] = int(source['original_max_position_embeddings'])
  out['yarn_beta_fast'] = float(source.get('beta_fast', 32.0))
  out['yarn_beta_slow'] = float(source.get('beta_slow', 1.0))
  for key in ('rope_theta', 'compress_rope_theta'):  # V4-style nested form carries the thetas
    sub = params.get('main' if key == 'rope_theta' else 'compress')
    if isinstance(sub, dict) and 'rope_theta' in sub and key not in text:
      out[key] = float(sub['rope_theta'])


def _layer_defaults(text: dict, n: int, ratios: tuple[int, ...]) -> dict:
  """The source schedules, with the HF config's own defaults where a field is absent."""
  kv = text.get('kv_source_layer_ids')
  if kv is None:  # the first layer of each same-ratio run publishes (HF's default rule)
    kv = [i for i in range(n) if ratios[i] > 0 and (i == 0 or ratios[i - 1] != ratios[i])]
  index = text.get('index_source_layer_ids')
  if index is None:
    index = list(kv)
  cand = text.get('candidate_source_layer_id')
  if cand is None:
    cand = kv[-1] if kv else -1
  return {'kv_source_layer_ids': tuple(int(i) for i in kv),
          'index_source_layer_ids': tuple(int(i) for i in index),
          'candidate_source_layer_id': int(cand) if int(cand) >= 0 else -1}


def model_from_hf(config: dict) -> tuple[dict[str, Any], dict[str, Any], list[str]]:
  """(model key overrides, dspark key overrides, notes) from a config.json dict.

  Raises HFConfigError naming the first field that does not fit.
  """
  text, top = text_config(config)
  for key in top:
    if key not in ('vision_config', 'image_token_id', 'tie_word_embeddings',
                   'quantization_config') and key not in BOOKKEEPING:
      raise HFConfigError(f'config.json field {key!r} is not supported (not part of the '
                          'deepseek_v41 format this importer knows)')
  known = set(DIRECT) | set(FIXED) | set(DSPARK) | BOOKKEEPING | {
      'compress_ratios', 'kv_source_layer_ids', 'index_source_layer_ids',
      'candidate_source_layer_id', 'rope_scaling', 'rope_parameters', 'engram_layer_ids',
      'engram_num_embeddings', 'quantization_config'}
  for key in text:
    if key not in known:
      raise HFConfigError(f'config.json text field {key!r} is not supported: it has no '
                          'counterpart in deepseek41 (docs/hf_interop.md, "Config fields")')
  for key, want in FIXED.items():
    have = text.get(key, want)
    if key == 'tie_word_embeddings':  # a top-level field of the composite config
      have = top.get(key, have)
    if have != want:
      raise HFConfigError(f'config.json {key}={have!r}: deepseek41 implements only {want!r}')
  missing = [k for k in ('vocab_size', 'hidden_size', 'num_hidden_layers') if k not in text]
  if missing:
    raise HFConfigError(f'config.json lacks {missing[0]!r}')
  out: dict[str, Any] = {DIRECT[k]: v for k, v in text.items() if k in DIRECT}
  n = int(text['num_hidden_layers'])
  ratios = _ratios(text, n)
  out['compress_ratios'] = ratios
  out.update(_layer_defaults(text, n, ratios))
  if text.get('num_experts_per_tok', 6) < 2:
    raise HFConfigError('config.json num_experts_per_tok=1: HF does not normalise a single '
                        'expert weight and deepseek41 does; only top-k >= 2 is equivalent')
  if text.get('swiglu_limit', 10.0) <= 0:
    raise HFConfigError('config.json swiglu_limit <= 0 (no clamp) is not supported')
  _yarn(text, out)
  # CED split [I]: the encoder is every layer before the first ratio-1 (decoder) layer.
  first_decoder = next((i for i, r in enumerate(ratios) if r == 1), n)
  out['num_encoder_layers'] = first_decoder
  notes = [f'model.num_encoder_layers={first_decoder}: the layers before the first ratio-1 '
           'layer (HF has no CED field; the split changes nothing the forward computes)']
  engram_ids = tuple(int(i) for i in text.get('engram_layer_ids') or ())
  out['engram_layer_ids'] = engram_ids
  out['engram'] = bool(engram_ids)
  for key, (value, why) in EQUIVALENCE.items():
    if key in _QUANT_BLOCK:
      dim_key, block = _QUANT_BLOCK[key]
      dim = out.get(dim_key, 512 if dim_key == 'head_dim' else 128)
      if dim % block:  # HF leaves such shapes unquantized
        value, why = 'none', f'{dim_key}={dim} is not a multiple of {block}: HF skips it too'
    out[key] = value
    notes.append(f'model.{key}={value!r}: {why}')
  if 'image_token_id' in top:
    out['image_token_id'] = int(top['image_token_id'])
  dspark = {DSPARK[k]: (tuple(v) if isinstance(v, list) else v) for k, v in text.items()
            if k in DSPARK}
  if dspark.get('num_blocks', 0) == 0:
    dspark.pop('num_blocks', None)
  return out, dspark, notes


def check_engram_rows(model: ModelConfig, text: dict) -> None:
  """engram_num_embeddings must equal the rows our hashing addresses, layer by layer."""
  given = list(text.get('engram_num_embeddings') or [])
  if not model.engram:
    return
  rows = [layer_addresses(model)[l].rows for l in model.engram_layer_ids]
  if given and any(int(g) for g in given) and [int(g) for g in given] != rows:
    raise HFConfigError(f'config.json engram_num_embeddings={given}, but the prime buckets of '
                        f'engram_vocab_size={model.engram_vocab_start} give {rows} rows')


def numeric_differences(m: ModelConfig) -> list[str]:
  """Settings of `m` under which the HF implementation computes something else (same weights)."""
  out = []
  for key, (value, why) in EQUIVALENCE.items():
    have = getattr(m, key)
    if key in _QUANT_BLOCK and have == 'none':
      dim_key, block = _QUANT_BLOCK[key]
      if getattr(m, dim_key) % block:
        continue  # HF skips such shapes as well
    if have != value:
      out.append(f'model.{key}={have!r}, but {why} (model.{key}={value!r})')
  return out


def hf_from_model(m: ModelConfig, quantization: dict | None = None) -> dict:
  """The composite config.json of a deepseek41 model (inverse of `model_from_hf`). Structure the
  format cannot hold raises; `numeric_differences` lists what HF would compute differently."""
  if m.residual != 'mhc_single_pass' or not m.csa2:
    raise HFConfigError('the HF format holds single-pass mHC models with CSA2; this model has '
                        f'model.residual={m.residual!r}, '
                        f'model.attention_variant={m.attention_variant!r}')
  inverse = {ours: hf for hf, ours in DIRECT.items()}
  text = {hf: getattr(m, ours) for ours, hf in inverse.items()}
  text.update({k: v for k, v in FIXED.items() if k != 'tie_word_embeddings'})
  text['compress_ratios'] = list(m.compress_ratios)
  text['kv_source_layer_ids'] = list(m.kv_source_layer_ids)
  text['index_source_layer_ids'] = list(m.index_source_layer_ids)
  text['candidate_source_layer_id'] = m.candidate_source_layer_id
  engram = list(m.engram_layer_ids) if m.engram else []
  text['engram_layer_ids'] = engram
  text['engram_num_embeddings'] = [layer_addresses(m)[l].rows for l in engram]
  text['rope_scaling'] = None if m.yarn_factor == 1 else {
      'rope_type': 'yarn', 'factor': m.yarn_factor, 'beta_fast': m.yarn_beta_fast,
      'beta_slow': m.yarn_beta_slow,
      'original_max_position_embeddings': m.yarn_original_max_position}
  text['max_position_embeddings'] = int(m.yarn_original_max_position * m.yarn_factor)
  text['num_nextn_predict_layers'] = 0  # the drafter's weights are not in the format
  text['model_type'] = 'deepseek_v41_text'
  out = {'architectures': ['DeepseekV41ForCausalLM'], 'model_type': 'deepseek_v41',
         'text_config': text, 'tie_word_embeddings': False}
  if m.image_token_id:
    out['image_token_id'] = m.image_token_id
  if quantization:
    out['quantization_config'] = quantization
  return out
