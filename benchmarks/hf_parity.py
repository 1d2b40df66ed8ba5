"""Logit parity with the Hugging Face `deepseek_v41` implementation (docs/hf_interop.md, "Parity").

    .venv/bin/python -m pip install -e '.[hf]'
    python benchmarks/hf_parity.py [--hf_src=DIR] [--seq=64] [--rows=2] [--out=/tmp/parity]

Builds a small random HF V4.1 model that keeps every layer role (SWA, Full ratio 2 and 1,
Reuse, Reindex inside the candidate pool), Engram, mHC and the FP8/FP4 fake quantizers; saves it
with `save_pretrained`; imports it with `deepseek41.interop.hf_convert.import_hf`; runs both
forwards in float32 on the same tokens and prints the largest logit difference (and per-row
agreement of the top-1 token), next to a control: HF against itself with every weight moved by
a relative 1e-6, which shows how far float32 rounding noise alone moves the logits through the
model's discrete decisions (quantizer rounding, top-k). Then exports the imported checkpoint
(fp32) and loads it back into the HF model (`from_pretrained`): its tensors must equal the
original ones. Also counts values where our fake quantizers differ from HF's on the same inputs.
Exit status 1 if ours vs HF, or the reloaded HF model, differ by more than --tolerance.

`pip install -e '.[hf]'` takes torch from PyPI, a CUDA build of several GB; a CPU wheel from
the PyTorch index works as well.

The HF code comes from an installed transformers that has `models/deepseek_v41`, or from
--hf_src, a directory holding its `configuration_deepseek_v41.py` and
`modeling_deepseek_v41.py` (loaded as that subpackage of the installed transformers, whose other
modules it imports). Needs torch and transformers (the `hf` extra); never part of the tests.
"""

from __future__ import annotations

import argparse
import copy
import importlib
import importlib.util
import json
import os
import shutil
import sys
import tempfile
import time

os.environ.setdefault('JAX_PLATFORMS', 'cpu')

import numpy as np  # noqa: E402

HF_PACKAGE = 'transformers.models.deepseek_v41'


def load_hf(src: str | None):
  """(configuration module, modeling module) of deepseek_v41."""
  try:
    return (importlib.import_module(f'{HF_PACKAGE}.configuration_deepseek_v41'),
            importlib.import_module(f'{HF_PACKAGE}.modeling_deepseek_v41'))
  except ModuleNotFoundError:
    if not src:
      sys.exit('this transformers has no models/deepseek_v41: pass --hf_src=DIR with its source')
  import transformers.models  # noqa: F401 (the parent package of the one we add)
  init = os.path.join(src, '__init__.py')
  spec = importlib.util.spec_from_file_location(
      HF_PACKAGE, init if os.path.exists(init) else None, submodule_search_locations=[src])
  package = importlib.util.module_from_spec(spec)
  sys.modules[HF_PACKAGE] = package
  if spec.loader is not None:
    spec.loader.exec_module(package)
  return (importlib.import_module(f'{HF_PACKAGE}.configuration_deepseek_v41'),
          importlib.import_module(f'{HF_PACKAGE}.modeling_deepseek_v41'))


def text_config_fields(vocab: int, quantized: bool = True) -> dict:
  """Every role at toy size. Widths that are multiples of 32 make HF apply every fake quantizer;
  24 makes it skip them all (and the import sets ours to 'none' to match)."""
  width = 32 if quantized else 24
  return dict(
      vocab_size=vocab, hidden_size=64, num_hidden_layers=6, num_attention_heads=4,
      num_key_value_heads=1, head_dim=width, q_lora_rank=32, qk_rope_head_dim=16,
      rope_theta=10000.0, compress_rope_theta=160000.0,
      rope_scaling={'rope_type': 'yarn', 'factor': 4.0, 'beta_fast': 32.0, 'beta_slow': 1.0,
                    'original_max_position_embeddings': 16},
      max_position_embeddings=64, sliding_window=8,
      # 0 SWA | 1 Full r=2 | 2 Reuse r=2 | 3 Full r=1, candidate source | 4 Reindex | 5 Reuse
      compress_ratios=[0, 2, 2, 1, 1, 1], kv_source_layer_ids=[1, 3],
      index_source_layer_ids=[1, 3, 4], candidate_source_layer_id=3,
      candidate_topk_blocks=3, candidate_block_size=4, index_n_heads=16, index_head_dim=width,
      index_topk=6, o_groups=2, o_lora_rank=32, moe_intermediate_size=32, n_routed_experts=8,
      n_shared_experts=1, num_experts_per_tok=2, routed_scaling_factor=1.5, swiglu_limit=10.0,
      hc_mult=4, hc_sinkhorn_iters=20, hc_eps=1e-6, engram_layer_ids=[1, 4],
      engram_vocab_size=1000, engram_max_ngram_size=3, engram_n_heads=2, engram_head_dim=32,
      engram_pad_id=2, engram_compressed_vocab_size=vocab, num_nextn_predict_layers=0,
      rms_norm_eps=1e-6, initializer_range=0.02)


def identity_tokenizer(vocab: int):
  """A word-level tokenizer whose ids normalise to distinct strings: the Engram compression
  is the identity, so both sides hash the same ids."""
  from tokenizers import Tokenizer, models
  from transformers import PreTrainedTokenizerFast
  tok = Tokenizer(models.WordLevel({f'w{i}': i for i in range(vocab)}, unk_token='w0'))
  return PreTrainedTokenizerFast(tokenizer_object=tok)


def randomize(model, seed: int):
  """Weights far from the init (norm scales, sinks, mHC biases, router biases all nonzero), so
  every mechanism shapes the logits."""
  import torch
  g = torch.Generator().manual_seed(seed)
  with torch.no_grad():
    for name, p in model.named_parameters():
      r = torch.randn(p.shape, generator=g, dtype=torch.float32)
      if name.endswith('norm.weight') or name.endswith(('q_weight', 'k_weight')):
        v = 1.0 + 0.2 * r
      elif 'hc_' in name and name.endswith('_scale'):
        v = 1.0 + 0.3 * r
      elif 'hc_' in name:
        v = 0.3 * r
      elif name.endswith(('attn_sink', 'gate.bias', 'gate.bias_vl')):
        v = 0.5 * r
      elif name.endswith('embed.scale'):
        v = torch.ones_like(r)
      elif p.ndim == 2:
        v = r / np.sqrt(p.shape[1])
      else:
        v = r
      p.copy_(v.to(p.dtype))


def hf_cache(model_mod, text):
  """The HF cache of one forward, built here: this transformers' `DynamicCache(config=...)`
  constructs cache layers without passing the config, which `DeepseekV41CSACache` needs.

  The cache is not optional for equivalence: without it (`use_cache=False`) a second KV source
  appends its compressed entries to the first source's in the per-forward `shared` dict
  (docs/hf_interop.md, "Parity").
  """
  from transformers.cache_utils import DynamicCache, DynamicSlidingWindowLayer
  cache = DynamicCache()
  cache.layers = [model_mod.DeepseekV41CSACache(text) if t == 'shared_compressed_attention'
                  else DynamicSlidingWindowLayer(sliding_window=text.sliding_window)
                  for t in text.layer_types]
  return cache


def our_logits(workdir: str, tokens: np.ndarray) -> np.ndarray:
  import jax
  from flax import nnx
  from deepseek41.config import load_config_file, resolve
  from deepseek41.sharding import make_mesh
  from deepseek41.train import state as state_lib
  from deepseek41.train.checkpoint import Checkpointer
  from deepseek41.train.objectives import objective_for
  from deepseek41.train.optimizer import make_optimizer
  run = resolve(load_config_file(os.path.join(workdir, 'config.py')), backend='cpu')
  tx = make_optimizer(run.train)
  abstract = state_lib.abstract_state(run, tx)
  shardings = state_lib.state_shardings(abstract, make_mesh(run.mesh), run.mesh.rules)
  ckpt = Checkpointer(workdir, run.checkpoint, primary=False)
  state = ckpt.restore(0, state_lib.with_shardings(abstract, shardings), None)
  ckpt.close()
  graphdef = state_lib.model_def(run, tx).graphdef
  model, _ = objective_for(run).reader_models(graphdef, state)
  b, t = tokens.shape
  batch = {'tokens': tokens.astype(np.int32), 'engram_tokens': tokens.astype(np.int32),
           'segment_ids': np.ones((b, t), np.int32),
           'positions': np.broadcast_to(np.arange(t, dtype=np.int32), (b, t)).copy(),
           'modality': np.zeros((b, t), np.int32)}
  logits, _ = nnx.jit(lambda m, x: m(x))(model, batch)
  return np.asarray(jax.device_get(logits), np.float32)


def quantizer_mismatches(model_mod, seed: int, n: int = 1 << 20) -> dict[str, int]:
  """Values where our fake quantizers differ from HF's on the same fp32 inputs (expected: 0)."""
  import torch
  from deepseek41.quant import get_fake_quant
  hf = {'fp4_e4m3_16': lambda t: model_mod._fake_quant_fp4_block(t, 16, e4m3_scales=True),
        'fp4_ue8m0_32': lambda t: model_mod._fake_quant_fp4_block(t, 32),
        'fp8_ue8m0_32': lambda t: model_mod._fake_quant_fp8_block(t, 32)}
  rng = np.random.default_rng(seed)
  x = (rng.standard_normal((n // 64, 64)) *
       np.exp(rng.uniform(-4, 4, (n // 64, 1)))).astype(np.float32)
  return {name: int(np.sum(np.asarray(get_fake_quant(name)(x)) != fn(torch.tensor(x)).numpy()))
          for name, fn in hf.items()}


def main():
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument('--hf_src', default=None, help='directory of the deepseek_v41 source files')
  ap.add_argument('--vocab', type=int, default=512)
  ap.add_argument('--seq', type=int, default=64)
  ap.add_argument('--rows', type=int, default=2)
  ap.add_argument('--seed', type=int, default=0)
  ap.add_argument('--tolerance', type=float, default=1e-4)
  ap.add_argument('--no_quant', action='store_true',
                  help='head widths of 24: neither side applies the FP8/FP4 fake quantizers')
  ap.add_argument('--out', default=None, help='keep the HF checkpoint and the work directory here')
  args = ap.parse_args()

  import torch
  from transformers.utils import logging as hf_logging
  hf_logging.set_verbosity_error()
  hf_logging.disable_progress_bar()
  import logging
  logging.getLogger('transformers.utils.auto_docstring').setLevel(logging.CRITICAL)
  conf_mod, model_mod = load_hf(args.hf_src)
  torch.manual_seed(args.seed)
  text = conf_mod.DeepseekV41TextConfig(**text_config_fields(args.vocab, not args.no_quant))
  layout = model_mod.EngramLayout.from_config(text)
  text.engram_num_embeddings = [sum(sum(p) for p in layer) for layer in layout.primes]
  config = conf_mod.DeepseekV41Config(text_config=text.to_dict())
  config.text_config.engram_num_embeddings = text.engram_num_embeddings
  model = model_mod.DeepseekV41ForCausalLM(config).float().eval()
  randomize(model, args.seed)
  model.model.bind_tokenizer(identity_tokenizer(args.vocab))

  root = args.out or tempfile.mkdtemp(prefix='hf_parity_')
  hf_dir, workdir = os.path.join(root, 'hf'), os.path.join(root, 'imported')
  for d in (hf_dir, workdir):
    shutil.rmtree(d, ignore_errors=True)
  model.save_pretrained(hf_dir)

  rng = np.random.default_rng(args.seed)
  tokens = rng.integers(3, args.vocab, (args.rows, args.seq))
  t0 = time.perf_counter()
  with torch.no_grad():
    hf = model(input_ids=torch.tensor(tokens), use_cache=True,
               past_key_values=hf_cache(model_mod, model.config)).logits.float().numpy()
    hf_nocache = model(input_ids=torch.tensor(tokens), use_cache=False).logits.float().numpy()
  t_hf = time.perf_counter() - t0

  # Control: HF against itself with every weight moved by a relative 1e-6 (float32 rounding
  # noise). Discrete decisions (quantizer rounding, top-k) amplify such noise the same way they
  # amplify the summation-order differences between the two implementations.
  noisy = copy.deepcopy(model)
  g = torch.Generator().manual_seed(args.seed + 1)
  with torch.no_grad():
    for p in noisy.parameters():
      p.mul_(1 + 1e-6 * torch.randn(p.shape, generator=g))
    hf_noisy = noisy(input_ids=torch.tensor(tokens), use_cache=True,
                     past_key_values=hf_cache(model_mod, noisy.config)).logits.float().numpy()
  del noisy

  from deepseek41.interop.hf_convert import import_hf
  import_hf(hf_dir, workdir, progress=False, say=lambda s: print('  import:', s))
  t0 = time.perf_counter()
  ours = our_logits(workdir, tokens)
  t_ours = time.perf_counter() - t0

  # The other direction: export the imported checkpoint and load it with the HF code.
  from deepseek41.interop.hf_convert import export_hf
  exported = os.path.join(root, 'exported')
  shutil.rmtree(exported, ignore_errors=True)
  export_hf(workdir, exported, dtype='fp32', progress=False, say=lambda s: None)
  reloaded = model_mod.DeepseekV41ForCausalLM.from_pretrained(exported).float().eval()
  reloaded.model.bind_tokenizer(identity_tokenizer(args.vocab))
  with torch.no_grad():
    hf_reloaded = reloaded(input_ids=torch.tensor(tokens), use_cache=True,
                           past_key_values=hf_cache(model_mod, reloaded.config)).logits.numpy()

  before, after = model.state_dict(), reloaded.state_dict()
  differing = sorted(k for k in before if k not in after or not torch.equal(before[k], after[k]))
  diff = np.abs(ours - hf)
  per_position = diff.max(-1)
  result = {
      'quantizers': not args.no_quant,
      'positions_within_tolerance': float(np.mean(per_position <= args.tolerance)),
      'max_abs_diff': float(diff.max()), 'mean_abs_diff': float(diff.mean()),
      'logit_scale': float(np.abs(hf).max()),
      'top1_agreement': float(np.mean(ours.argmax(-1) == hf.argmax(-1))),
      'max_abs_diff_hf_without_cache': float(np.abs(ours - hf_nocache).max()),
      'control_hf_vs_hf_with_1e-6_weight_noise': float(np.abs(hf_noisy - hf).max()),
      'hf_reloaded_from_export_max_abs_diff_to_hf': float(np.abs(hf_reloaded - hf).max()),
      'hf_reloaded_tensors_differing': differing,
      'worst_position': [int(i) for i in np.unravel_index(diff.argmax(), diff.shape)[:2]],
      'first_divergence_per_row': [int(np.argmax(r > args.tolerance)) if np.any(r > args.tolerance)
                                   else None for r in per_position],
      'quantizer_mismatches_of_1M': quantizer_mismatches(model_mod, args.seed),
      'rows': args.rows, 'seq': args.seq, 'seconds_hf': round(t_hf, 2),
      'seconds_ours_with_compile': round(t_ours, 2), 'torch': torch.__version__,
  }
  print(json.dumps(result, indent=2))
  if not args.out:
    shutil.rmtree(root, ignore_errors=True)
  ok = max(result['max_abs_diff'], result['hf_reloaded_from_export_max_abs_diff_to_hf'])
  sys.exit(0 if ok <= args.tolerance else 1)


if __name__ == '__main__':
  main()
