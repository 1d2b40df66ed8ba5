"""`Generator`: a checkpoint, its tokenizer, prefill and decoding (plain or speculative with DSpark).

    gen = Generator('runs/tiny')                      # the newest checkpoint; step=N for another
    for r in gen.generate(['def main(', 'import'], max_new_tokens=32, temperature=0.0):
      print(r.text, r.tokens_per_s)

The checkpoint's own config builds the model (its execution choices re-resolved for the devices
at hand, the routed experts dropless as in evaluation); prompts of different lengths share one
right-padded prefill. Prefill is CED by default where the model has an encoder/decoder split:
the decoder runs over the last `n_win` prompt tokens, by default just enough that its windows
hold exactly what the full forward would (decode after it is exact; decode.py). Speculative
decoding needs a checkpoint whose objective trained a drafter (a DSpark stage); the objective
(train/objectives/) says where backbone and drafter lie in the restored weights.
"""

from __future__ import annotations

import dataclasses
import os
import time
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from deepseek41.batch import ROLE_PATCH
from deepseek41.config import RunConfig, resolve
from deepseek41.config import max_positions as config_max_positions
from deepseek41.data.engram_vocab import compression_map
from deepseek41.data.multimodal import build_document
from deepseek41.data.shards import DataError
from deepseek41.generate import sampling
from deepseek41.generate.cache import empty_cache
from deepseek41.generate.decode import ced_prefill, forward_chunk
from deepseek41.model.ced import tail_reach
from deepseek41.model.layer_cache import CacheSpec, ring_slots, scatter_rows
from deepseek41.sharding import make_mesh
from deepseek41.train import state as state_lib
from deepseek41.train.checkpoint import CheckpointError
from deepseek41.train.optimizer import make_optimizer
from deepseek41.train.reading import checkpoint_step, portable_config, run_tokenizer
from deepseek41.train.warm_start import restore_weights

class GenerateError(ValueError):
  """Bad input to generation; the message names the culprit (workdir, step, prompt, flag)."""


@dataclasses.dataclass
class Result:
  prompt_tokens: list[int]
  tokens: list[int]           # the generated tokens (up to, not including, end-of-document)
  text: str
  prefill_s: float
  decode_s: float             # wall time of the decode loop (compilation excluded)
  forwards: int               # backbone forwards after prefill
  accepted_drafts: int        # speculative: drafts accepted over all verifications
  timed_tokens: int           # the tokens decode_s covers (after the first, compiling step)

  @property
  def tokens_per_s(self) -> float:
    return self.timed_tokens / self.decode_s if self.decode_s > 0 else float('nan')


def max_positions(cfg: RunConfig) -> int:
  """The longest sequence the model is configured for (config.max_positions)."""
  return config_max_positions(cfg.model, cfg.data.seq_len)


def exact_n_win(cfg: RunConfig) -> int:
  """The CED tail after which the decoder's windows are exact: every row of the last window
  lies in the exact part of the tail (model/ced.py's `exact_tail_rows`)."""
  return tail_reach(cfg.model) + cfg.model.sliding_window


def generation_config(saved: dict, backend: str | None = None) -> RunConfig:
  """The checkpoint's config with its execution choices resolved for this backend and the
  decode-friendly XLA paths (one query row at a time tiles no kernel)."""
  c = portable_config(saved)
  c.model.attention_impl = 'chunked'
  c.model.index_impl = 'reference'
  c.model.sparse_impl = 'gathered'
  c.data.synthetic = True  # nothing is read: resolve checks no data
  c.train.remat = 'none'
  cfg = resolve(c, backend=backend)
  return dataclasses.replace(cfg, model=dataclasses.replace(
      cfg.model, moe_backend=cfg.model.eval_moe_backend))


def saved_data_config(saved: dict):
  """The run's own data section (its sources and cache)."""
  return resolve(portable_config(saved)).data


class Generator:
  """A restored checkpoint ready to generate."""

  def __init__(self, workdir: str, step: int | None = None):
    workdir = os.path.abspath(workdir)
    try:
      step, step_dir, saved = checkpoint_step(workdir, step)
      self.cfg = cfg = generation_config(saved)
      self.data_cfg = saved_data_config(saved)
      self.tokenizer, _ = run_tokenizer(workdir, self.data_cfg)
    except (CheckpointError, DataError) as e:
      raise GenerateError(str(e)) from None
    if self.tokenizer.vocab_size > cfg.model.vocab_size:
      raise GenerateError(f'{workdir}: the tokenizer has {self.tokenizer.vocab_size} ids, the '
                          f'model {cfg.model.vocab_size}')
    engram_map = compression_map(cfg.model, self.tokenizer.hf,
                                 f'the tokenizer {self.tokenizer.source}')
    self.engram_map = None if engram_map is None else jnp.asarray(engram_map)
    self.mesh = make_mesh(cfg.mesh)
    try:
      objective, restored, _ = restore_weights('--step', step_dir, cfg, self.mesh)
    except CheckpointError as e:
      raise GenerateError(str(e)) from None
    graphdef = state_lib.model_def(cfg, make_optimizer(cfg.train)).graphdef
    self.model, self.dspark = objective.reader_models(graphdef, restored)
    self.step = step
    self.workdir = workdir
    self._programs = Programs(self.model, self.dspark, self.engram_map)

  def encode(self, prompts: Sequence) -> tuple[list[np.ndarray], list | None]:
    """(token ids per prompt, its image document or None per prompt). A prompt is a string or
    a list of parts {'text': str} / {'image': path or uint8 [H, W, 3]}, laid out as training
    lays out images (data/multimodal.py: the span, its alignment pad)."""
    tokens, docs = [], []
    for i, prompt in enumerate(prompts):
      parts = [{'text': prompt}] if isinstance(prompt, str) else list(prompt)
      if any('image' in p for p in parts):
        if not self.cfg.model.vision:
          raise GenerateError(f'prompt {i} has an image but the model has no vision tower '
                              '(model.vision is off)')
        doc = build_document(parts, self._encode_text, self.tokenizer.eos_id,
                             self.cfg.data.images, f'prompt {i}')
        ids = doc.tokens[:-1]  # the document's eos: a prompt continues
        docs.append(doc)
      else:
        ids = np.asarray(sum((self._encode_text(p['text']) for p in parts), []), np.int32)
        docs.append(None)
      if not len(ids):
        raise GenerateError(f'prompt {i} is empty: give at least one token of text')
      tokens.append(np.asarray(ids, np.int32))
    return tokens, (docs if any(d is not None for d in docs) else None)

  def _encode_text(self, text: str) -> list[int]:
    return self.tokenizer.hf.encode(text, add_special_tokens=False).ids

  def generate(self, prompts: Sequence, **kw) -> list[Result]:
    tokens, docs = self.encode(prompts)
    results = self.generate_tokens(tokens, image_docs=docs, **kw)
    for r in results:
      r.text = self.tokenizer.decode(r.tokens)
    return results

  def generate_tokens(self, prompts: Sequence[np.ndarray], *, speculative: bool = False,
                      **kw) -> list[Result]:
    """Generate after each prompt (token ids; `image_docs` from `encode` for image prompts).
    Returns one Result per prompt, in order."""
    if speculative and self.dspark is None:
      raise GenerateError(f'--speculative needs a DSpark-stage checkpoint; {self.workdir} holds '
                          'no drafter (a pretraining run: dspark.stage = off)')
    with jax.set_mesh(self.mesh):
      return decode_loop(self._programs, self.cfg, prompts, eos_id=self.tokenizer.eos_id,
                         speculative=speculative, **kw)


def image_fields(cfg: RunConfig, docs: list, t: int) -> dict[str, np.ndarray]:
  """The batch contract's image fields for right-padded prompts of `t` positions; `docs[i]` is
  prompt i's document (data/multimodal.py) or None for a text prompt."""
  geometry = cfg.data.images
  b, m = len(docs), geometry.max_image_tokens
  slots = max(1, max(len(d.patches) for d in docs if d is not None))
  p = geometry.patch_size
  out = {'image_role': np.zeros((b, t), np.int32), 'image_index': np.zeros((b, t), np.int32),
         'image_span': np.zeros((b, t), np.int32),
         'image_patches': np.zeros((b, slots, geometry.max_patches, p * p * 3), np.uint8),
         'image_grid': np.zeros((b, slots, 2), np.int32)}
  for i, d in enumerate(docs):
    if d is None:
      continue
    n = len(d.tokens) - 1
    out['image_role'][i, :n] = d.role[:n]
    out['image_span'][i, :n] = d.span[:n]
    patch = d.role[:n] == ROLE_PATCH  # the row's image slot n takes indices n*M + i*wm + j
    out['image_index'][i, :n] = np.where(patch, d.index[:n] + (d.span[:n] - 1) * m, 0)
    for k, (pd, grid) in enumerate(zip(d.patches, d.grids)):
      out['image_patches'][i, k, :len(pd)] = pd
      out['image_grid'][i, k] = grid
  return out


def decode_loop(progs: 'Programs', cfg: RunConfig, prompts: Sequence[np.ndarray], *,
                eos_id: int | None, max_new_tokens: int = 64, temperature: float = 0.0,
                top_p: float = 1.0, seed: int = 0, speculative: bool = False,
                prefill: str = 'auto', n_win: int = 0, verify_cost: float = 0.05,
                draft_len: int = 0, image_docs: list | None = None) -> list[Result]:
  """Prefill the prompts as one right-padded batch, then decode until every row has
  max_new_tokens or its end-of-document (eos_id; None: never stop early)."""
  if not len(prompts):
    raise GenerateError('no prompts given')
  if max_new_tokens < 1:
    raise GenerateError(f'--max_new_tokens must be >= 1, got {max_new_tokens}')
  if not 0 < top_p <= 1:
    raise GenerateError(f'--top_p must be in (0, 1], got {top_p}')
  k = cfg.dspark.block_size if speculative else 0
  k = min(k, draft_len) if draft_len else k
  lengths = np.asarray([len(p) for p in prompts], np.int32)
  limit = max_positions(cfg)
  for i, n in enumerate(lengths):
    if n + max_new_tokens + k + 1 > limit:
      raise GenerateError(f'prompt {i}: {n} tokens + --max_new_tokens={max_new_tokens} exceed '
                          f'the model\'s {limit} positions (model.yarn_original_max_position x '
                          'model.yarn_factor)')
  split = 0 < cfg.model.num_encoder_layers < cfg.model.num_layers
  if prefill == 'auto':
    prefill = 'ced' if split else 'full'
  if prefill not in ('ced', 'full'):
    raise GenerateError(f'--prefill must be auto, ced or full, got {prefill!r}')
  if prefill == 'ced' and not split:
    raise GenerateError('--prefill=ced needs model.num_encoder_layers between 0 and '
                        'model.num_layers')
  t = int(-(-lengths.max() // 16) * 16)  # fewer prefill shapes to compile
  spec = CacheSpec(batch=len(prompts), max_len=t + max_new_tokens + k + 1, max_chunk=k + 1)
  tokens_bt = np.zeros((len(prompts), t), np.int32)
  for i, p in enumerate(prompts):
    tokens_bt[i, :len(p)] = p
  images = None if image_docs is None else \
      jax.tree.map(jnp.asarray, image_fields(cfg, image_docs, t))
  key = jax.random.key(seed)
  feature_dim = cfg.model.d_model if speculative else 0
  cache = empty_cache(progs.model, spec, feature_dim)
  t0 = time.perf_counter()
  if prefill == 'ced':
    win = min(n_win or exact_n_win(cfg), t)
    logits_last, cache = progs.prefill_ced(cache, jnp.asarray(tokens_bt), jnp.asarray(lengths),
                                           win, speculative, images)
  else:
    logits_last, cache = progs.prefill_full(cache, jnp.asarray(tokens_bt),
                                            jnp.asarray(lengths), speculative, images)
  key, sub = jax.random.split(key)
  nxt = sampling.draw(sub, sampling.probs(logits_last, temperature, top_p))
  nxt = np.asarray(nxt)
  prefill_s = time.perf_counter() - t0

  out = [[int(nxt[i])] for i in range(len(prompts))]
  done = np.zeros(len(prompts), bool)
  eos = eos_id

  def update_done():
    for i in range(len(prompts)):
      if not done[i]:
        if eos is not None and eos in out[i]:
          out[i] = out[i][:out[i].index(eos)]
          done[i] = True
        elif len(out[i]) >= max_new_tokens:
          out[i] = out[i][:max_new_tokens]
          done[i] = True
  update_done()
  forwards, accepted = 0, np.zeros(len(prompts), np.int64)
  decode_s, first = 0.0, True
  untimed = [len(o) for o in out]
  while not done.all():
    t1 = time.perf_counter()
    key, sub = jax.random.split(key)
    if speculative:
      key, dkey = jax.random.split(key)
      drafts, q, conf = progs.draft(cache, jnp.asarray(nxt), dkey, temperature, top_p, k)
      admit = np.array(sampling.verify_length(conf, verify_cost))
      admit[done] = 0
      j = int(admit.max())
    else:
      j = 0
    if j == 0:
      nxt_dev, cache = progs.plain(cache, jnp.asarray(nxt), sub, temperature, top_p,
                                   speculative)
      emitted = [[int(x)] for x in np.asarray(nxt_dev)]
    else:
      acc, nxt_dev, cache = progs.verify(cache, jnp.asarray(nxt), drafts[:, :j], q[:, :j],
                                         jnp.asarray(admit), sub, temperature, top_p)
      acc, d, nxt_host = np.asarray(acc), np.asarray(drafts), np.asarray(nxt_dev)
      emitted = [list(d[i, :acc[i]]) + [int(nxt_host[i])] for i in range(len(prompts))]
      accepted += np.where(done, 0, acc)
    nxt = np.asarray(nxt_dev)
    forwards += 1
    for i in range(len(prompts)):
      if not done[i]:
        out[i].extend(int(x) for x in emitted[i])
    update_done()
    if first:  # the first step compiles: timed from the second on
      first = False
      untimed = [len(o) for o in out]
    else:
      decode_s += time.perf_counter() - t1
  return [Result(prompt_tokens=[int(x) for x in p], tokens=out[i], text='',
                 prefill_s=prefill_s, decode_s=decode_s, forwards=forwards,
                 accepted_drafts=int(accepted[i]),
                 timed_tokens=max(0, len(out[i]) - untimed[i])) for i, p in enumerate(prompts)]


def _write_features(dspark, cache, captured, valid_bq, start_b):
  """DSpark's context m_t of the chunk's rows into the cache's feature ring."""
  m_bqd = dspark.context(captured)
  tq = valid_bq.shape[1]
  pos_bq = start_b[:, None] + jnp.arange(tq, dtype=jnp.int32)[None, :]
  end_b = start_b + jnp.sum(valid_bq, axis=1, dtype=jnp.int32)
  cap = cache['feat_pos'].shape[1]
  slots = ring_slots(pos_bq, valid_bq, end_b, cap)
  return {**cache, 'feat': scatter_rows(cache['feat'], slots, m_bqd),
          'feat_pos': scatter_rows(cache['feat_pos'], slots, pos_bq)}


class Programs:
  """The jitted pieces of generation over the split model state (merged inside each program)."""

  def __init__(self, model, dspark, engram_map):
    self.model = model  # its layers build the caches (`empty_cache`)
    self.graph, self.state = nnx.split((model, dspark))
    self.engram_map = engram_map
    self._jit = {}

  def _merged(self, state):
    return nnx.merge(self.graph, state)

  def _compiled(self, name, fn, static):
    if name not in self._jit:
      self._jit[name] = jax.jit(fn, static_argnames=static)
    return self._jit[name]

  def prefill_full(self, cache, tokens_bt, lengths_b, features: bool, images=None):
    def run(state, cache, tokens_bt, lengths_b, images, features):
      model, dspark = self._merged(state)
      valid = jnp.arange(tokens_bt.shape[1])[None, :] < lengths_b[:, None]
      start = jnp.zeros_like(lengths_b)
      logits, captured, cache = forward_chunk(
          model, cache, tokens_bt, valid, engram_map=self.engram_map,
          capture_layers=dspark.targets if features else (), images=images)
      if features:
        cache = _write_features(dspark, cache, captured, valid, start)
      last = jnp.take_along_axis(logits, (lengths_b - 1)[:, None, None], axis=1)[:, 0]
      return last, cache
    return self._compiled('prefill_full', run, ('features',))(
        self.state, cache, tokens_bt, lengths_b, images, features=features)

  def prefill_ced(self, cache, tokens_bt, lengths_b, n_win: int, features: bool, images=None):
    def run(state, cache, tokens_bt, lengths_b, images, n_win, features):
      model, dspark = self._merged(state)
      logits, captured, cache = ced_prefill(
          model, cache, tokens_bt, lengths_b, n_win, engram_map=self.engram_map,
          capture_layers=dspark.targets if features else (), images=images)
      tail_b = jnp.maximum(lengths_b - n_win, 0)
      if features:
        valid = (tail_b[:, None] + jnp.arange(n_win)[None, :]) < lengths_b[:, None]
        cache = _write_features(dspark, cache, captured, valid, tail_b)
      last = jnp.take_along_axis(logits, (lengths_b - 1 - tail_b)[:, None, None], axis=1)[:, 0]
      return last, cache
    return self._compiled('prefill_ced', run, ('n_win', 'features'))(
        self.state, cache, tokens_bt, lengths_b, images, n_win=n_win, features=features)

  def plain(self, cache, tok_b, key, temperature, top_p, features: bool):
    def run(state, cache, tok_b, key, temperature, top_p, features):
      model, dspark = self._merged(state)
      start = cache['length']
      valid = jnp.ones((tok_b.shape[0], 1), bool)
      logits, captured, cache = forward_chunk(
          model, cache, tok_b[:, None], valid, engram_map=self.engram_map,
          capture_layers=dspark.targets if features else ())
      if features:
        cache = _write_features(dspark, cache, captured, valid, start)
      return sampling.draw(key, sampling.probs(logits[:, 0], temperature, top_p)), cache
    return self._compiled('plain', run, ('temperature', 'top_p', 'features'))(
        self.state, cache, tok_b, key, temperature=temperature, top_p=top_p, features=features)

  def draft(self, cache, anchor_b, key, temperature, top_p, k: int):
    def run(state, cache, anchor_b, key, temperature, top_p, k):
      model, dspark = self._merged(state)
      p_b = cache['length']
      w = model.cfg.sliding_window
      fpos = cache['feat_pos']
      ok = (fpos >= 0) & (fpos >= p_b[:, None] - w) & (fpos < p_b[:, None])
      context = {'m_nwd': cache['feat'], 'positions_nw': jnp.maximum(fpos, 0), 'ok_nw': ok}
      h_nkd, base_nkv, _ = dspark.draft_rows(anchor_b, p_b, context, model.embed[...],
                                             model.head[...])
      prev, drafts, qs, confs = anchor_b, [], [], []
      for slot, sub in enumerate(jax.random.split(key, k)):
        bias_n1v, e_n1r = dspark.markov(prev[:, None])
        q_nv = sampling.probs(base_nkv[:, slot] + bias_n1v[:, 0], temperature, top_p)
        prev = sampling.draw(sub, q_nv)
        conf = jax.nn.sigmoid(dspark.confidence_logit(h_nkd[:, slot:slot + 1], e_n1r))[:, 0]
        drafts.append(prev)
        qs.append(q_nv)
        confs.append(conf)
      return jnp.stack(drafts, 1), jnp.stack(qs, 1), jnp.stack(confs, 1)
    return self._compiled('draft', run, ('temperature', 'top_p', 'k'))(
        self.state, cache, anchor_b, key, temperature=temperature, top_p=top_p, k=k)

  def verify(self, cache, anchor_b, drafts_bj, q_bjv, admit_b, key, temperature, top_p):
    def run(state, cache, anchor_b, drafts_bj, q_bjv, admit_b, key, temperature, top_p):
      model, dspark = self._merged(state)
      start = cache['length']
      chunk = jnp.concatenate([anchor_b[:, None], drafts_bj], axis=1)
      valid = jnp.ones(chunk.shape, bool)
      logits, captured, cache = forward_chunk(model, cache, chunk, valid,
                                              engram_map=self.engram_map,
                                              capture_layers=dspark.targets)
      cache = _write_features(dspark, cache, captured, valid, start)
      p_bjv = sampling.probs(logits, temperature, top_p)
      acc, nxt = sampling.verify(key, p_bjv, q_bjv, drafts_bj, admit_b, greedy=temperature <= 0)
      return acc, nxt, {**cache, 'length': start + acc + 1}
    return self._compiled('verify', run, ('temperature', 'top_p'))(
        self.state, cache, anchor_b, drafts_bj, q_bjv, admit_b, key, temperature=temperature,
        top_p=top_p)
