"""`Generator`: a checkpoint, its tokenizer, prefill and decoding (plain or speculative with DSpark).

    gen = Generator('runs/tiny')                      # the newest checkpoint; step=N for another
    for r in gen.generate(['def main(', 'import'], max_new_tokens=32, temperature=0.0):
      print(r.text, r.tokens_per_s)

The checkpoint's own config builds the model (its execution choices re-resolved for the devices
at hand, the routed experts dropless as in evaluation); prompts of different lengths share one
right-padded prefill, padded to a length bucket (`length_bucket`) so that prompts of similar
lengths reuse the compiled programs. Prefill is CED by default where the model has an
encoder/decoder split: the decoder runs over the last `n_win` prompt tokens, by default just
enough that its windows hold exactly what the full forward would (decode after it is exact;
decode.py). Speculative decoding needs a checkpoint whose objective trained a drafter (a DSpark
stage); the objective (train/objectives/) says where backbone and drafter lie in the restored
weights.

Plain decoding runs `tokens_per_dispatch` steps per dispatch on the device (`Programs.
decode_steps`: a while loop with the caches, the last token, the key and each row's done flag
and remaining budget as its carry), one host round trip per dispatch; `tokens_per_dispatch=1`
is the one-step loop, a dispatch and a round trip per token, against which the device loop is
tested. Speculative decoding runs rounds on the device the same way (`Programs.speculate`: per
round DSpark's k drafts, each row's verify length from their confidences, one verification of
fixed shape, the accepted tokens and the next, rows stopped by end-of-document or budget), up to
`tokens_per_dispatch` tokens a row per dispatch; with `tokens_per_dispatch=1` it drafts and
verifies once per round trip (`_one_step_loop`, the reference), its verification as long as
the longest admitted row. The programs themselves are programs.py's; this module drives them.
"""

from __future__ import annotations

import collections
import dataclasses
import os
import time
from typing import Callable, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from deepseek41.batch import ROLE_PATCH
from deepseek41.config import ConfigError, RunConfig, base_config, resolve
from deepseek41.config import max_positions as config_max_positions
from deepseek41.data.engram_vocab import compression_map
from deepseek41.data.multimodal import build_document
from deepseek41.data.shards import DataError
from deepseek41.generate import sampling
from deepseek41.generate.cache import empty_cache
from deepseek41.generate.programs import NO_TOKEN, Programs
from deepseek41.model.ced import tail_reach
from deepseek41.model.layer_cache import CacheSpec
from deepseek41.sharding import make_mesh
from deepseek41.train import state as state_lib
from deepseek41.train.checkpoint import EXECUTION_ONLY_MODEL_KEYS, CheckpointError
from deepseek41.train.optimizer import make_optimizer
from deepseek41.train.reading import checkpoint_step, portable_config, run_tokenizer
from deepseek41.train.warm_start import restore_weights

# Execution-only keys that change only decode-sized calls (fewer than one token block): a saved
# run's values are what its config held when it trained, so generation takes today's defaults
# (e.g. the split mHC walk, docs/performance.md section 59), and --execution on top.
DECODE_EXECUTION_KEYS = ('mhc_decode_block_d', 'mhc_decode_splits', 'moe_gather_small_calls',
                         'moe_small_call_block_m', 'decode_union_rows', 'decode_vector_dots')
TOKENS_PER_DISPATCH = 32  # plain decoding steps per dispatch to the device, by default
# Prompt positions per prefill dispatch, by default: longer prompts prefill in chunks, whose
# activations (not the prompt's) bound prefill's memory. 0: the whole prompt at once.
PREFILL_CHUNK = 65536


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


def generation_config(saved: dict, backend: str | None = None,
                      execution: Mapping[str, str] | None = None) -> RunConfig:
  """The checkpoint's config with its execution choices resolved for this backend and the
  decode-friendly XLA paths (one query row at a time tiles no kernel).

  execution: execution-only model keys to set on top ('model.<key>' -> its value as text, as
  on a command line), e.g. {'model.mhc_decode_block_d': '256'}; they change how the model is
  computed, never what it computes. Raises GenerateError naming a key that is not one.
  """
  c = portable_config(saved)
  defaults = base_config().model
  for key in DECODE_EXECUTION_KEYS:  # today's measured choices, not those of the run's day
    c.model[key] = defaults[key]
  c.model.attention_impl = 'chunked'
  c.model.index_impl = 'reference'
  c.model.sparse_impl = 'gathered'
  c.data.synthetic = True  # nothing is read: resolve checks no data
  c.train.remat = 'none'
  for name, text in (execution or {}).items():
    key = name.removeprefix('model.')
    if key not in EXECUTION_ONLY_MODEL_KEYS:
      raise GenerateError(f'execution override {name!r}: not an execution-only model key '
                          f'(one of {", ".join("model." + k for k in EXECUTION_ONLY_MODEL_KEYS)})')
    c.model[key] = _parsed(name, text, c.model[key])
  try:
    cfg = resolve(c, backend=backend)
  except ConfigError as e:
    raise GenerateError(str(e)) from None
  return dataclasses.replace(cfg, model=dataclasses.replace(
      cfg.model, moe_backend=cfg.model.eval_moe_backend))


def execution_overrides(items: Sequence[str]) -> dict[str, str]:
  """--execution's KEY=VALUE items as a dict; raises GenerateError naming a malformed one."""
  out = {}
  for item in items:
    key, sep, value = item.partition('=')
    if not sep or not key.strip():
      raise GenerateError(f'--execution: {item!r} is not KEY=VALUE')
    out[key.strip()] = value.strip()
  return out


def _parsed(name: str, text: str, default):
  """`text` as the type of the key's default (bool, int, float or str)."""
  if not isinstance(text, str):
    return text
  try:
    if isinstance(default, bool):
      if text.lower() not in ('true', 'false', '1', '0'):
        raise ValueError(text)
      return text.lower() in ('true', '1')
    return type(default)(text)
  except ValueError:
    raise GenerateError(f'execution override {name}={text!r}: expected a '
                        f'{type(default).__name__}') from None


def saved_data_config(saved: dict):
  """The run's own data section (its sources and cache)."""
  return resolve(portable_config(saved)).data


class Generator:
  """A restored checkpoint ready to generate."""

  def __init__(self, workdir: str, step: int | None = None,
               execution: Mapping[str, str] | None = None):
    """execution: execution-only model keys to override (`generation_config`)."""
    workdir = os.path.abspath(workdir)
    try:
      step, step_dir, saved = checkpoint_step(workdir, step)
      self.cfg = cfg = generation_config(saved, execution=execution)
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

  def generate(self, prompts: Sequence, *, stream: Callable[[int, str], None] | None = None,
               **kw) -> list[Result]:
    """One Result per prompt, with its text. `stream(row, text)` receives each row's text as it
    is generated (after every dispatch); the pieces of a row add up to its Result's text."""
    tokens, docs = self.encode(prompts)
    text = TextStream(self.tokenizer.decode)
    on_tokens = None if stream is None else \
        lambda row, new: stream(row, text.add(row, new))
    results = self.generate_tokens(tokens, image_docs=docs, stream=on_tokens, **kw)
    for row, r in enumerate(results):
      r.text = self.tokenizer.decode(r.tokens)
      if stream is not None:
        stream(row, text.rest(row, r.text))
    return results

  def generate_tokens(self, prompts: Sequence[np.ndarray], *, speculative: bool = False,
                      **kw) -> list[Result]:
    """Generate after each prompt (token ids; `image_docs` from `encode` for image prompts),
    with `decode_loop`'s options (max_new_tokens, per prompt or one for all; temperature,
    top_p, seed; tokens_per_dispatch; stream(row, tokens); ...). Returns one Result per
    prompt, in order."""
    if speculative and self.dspark is None:
      raise GenerateError(f'--speculative needs a DSpark-stage checkpoint; {self.workdir} holds '
                          'no drafter (a pretraining run: dspark.stage = off)')
    with jax.set_mesh(self.mesh):
      return decode_loop(self._programs, self.cfg, prompts, eos_id=self.tokenizer.eos_id,
                         speculative=speculative, **kw)


class TextStream:
  """Each row's text as its tokens arrive. `add` returns the text new tokens complete: decoding
  a longer prefix only appends, but for a character whose bytes are split across tokens, which
  waits for its last token. `rest` is what the final text adds to what was returned."""

  def __init__(self, decode: Callable[[list[int]], str]):
    self.decode = decode
    self.tokens = collections.defaultdict(list)
    self.sent = collections.defaultdict(str)

  def add(self, row: int, tokens: Sequence[int]) -> str:
    self.tokens[row].extend(int(x) for x in tokens)
    text = self.decode(self.tokens[row]).rstrip('\ufffd')  # an incomplete UTF-8 sequence
    if not text.startswith(self.sent[row]):
      return ''  # a tokenizer whose decoding revises earlier text: `rest` settles it
    new, self.sent[row] = text[len(self.sent[row]):], text
    return new

  def rest(self, row: int, text: str) -> str:
    sent = self.sent[row]
    return text[len(sent):] if text.startswith(sent) else '\n' + text


def length_bucket(n: int) -> int:
  """The padded length of n positions: a multiple of 16 up to 128, beyond that of an eighth
  of the next power of two (4 lengths per doubling, under 25% padding), so that prompts and
  caches of similar lengths share one compiled program."""
  step = max(16, (1 << max(n - 1, 1).bit_length()) // 8)
  return -(-n // step) * step


def row_budgets(max_new_tokens: int | Sequence[int], rows: int) -> np.ndarray:
  """int64 [rows]: each row's max_new_tokens (one int for every row, or one per row)."""
  if isinstance(max_new_tokens, (int, np.integer)):
    if max_new_tokens < 1:
      raise GenerateError(f'--max_new_tokens must be >= 1, got {max_new_tokens}')
    return np.full(rows, int(max_new_tokens), np.int64)
  budgets = np.asarray(list(max_new_tokens), np.int64)
  if budgets.shape != (rows,):
    raise GenerateError(f'max_new_tokens: {len(budgets)} budgets for {rows} prompts')
  for i, budget in enumerate(budgets):
    if budget < 1:
      raise GenerateError(f'max_new_tokens[{i}] (prompt {i}) must be >= 1, got {budget}')
  return budgets


class Rows:
  """Each row's generated tokens and whether it has finished: at its end-of-document (eos_id,
  which is not kept; None: never) or when it holds its budget."""

  def __init__(self, budgets: np.ndarray, eos_id: int | None):
    self.budgets = budgets
    self.eos_id = eos_id
    self.tokens: list[list[int]] = [[] for _ in budgets]
    self.done = np.zeros(len(budgets), bool)
    self.new: list[tuple[int, list[int]]] = []  # (row, tokens) added since `publish`

  def add(self, emitted: Sequence[Sequence[int]], finished: np.ndarray | None = None):
    """Each running row's emitted tokens, cut at its end-of-document or budget; `finished`
    marks rows whose end-of-document the device loop saw (and did not emit)."""
    for i, new in enumerate(emitted):
      if self.done[i]:
        continue
      row = self.tokens[i] + [int(x) for x in new]
      if self.eos_id is not None and self.eos_id in row:
        row, self.done[i] = row[:row.index(self.eos_id)], True
      if len(row) >= self.budgets[i]:
        row, self.done[i] = row[:self.budgets[i]], True
      if len(row) > len(self.tokens[i]):
        self.new.append((i, row[len(self.tokens[i]):]))
      self.tokens[i] = row
    if finished is not None:
      self.done |= finished

  def counts(self) -> np.ndarray:
    return np.asarray([len(t) for t in self.tokens], np.int64)

  def publish(self, stream: Callable[[int, list[int]], None] | None):
    for row, new in self.new if stream is not None else ():
      stream(row, new)
    self.new = []


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


# The host loop's verify cost per draft (--verify_cost's default there): its verification of j
# drafts is its own compiled shape, so admitting fewer saves work. The device loop verifies
# every draft in one shape, where admitting all (cost 0) accepts the most.
HOST_VERIFY_COST = 0.05


def default_verify_cost(verify_cost: float | None, tokens_per_dispatch: int) -> float:
  """`verify_cost`, or where None the loop's own: HOST_VERIFY_COST for the host loop
  (tokens_per_dispatch 1), 0 (every draft admitted) for the device loop."""
  if verify_cost is not None:
    return verify_cost
  return HOST_VERIFY_COST if tokens_per_dispatch == 1 else 0.0


def decode_loop(progs: Programs, cfg: RunConfig, prompts: Sequence[np.ndarray], *,
                eos_id: int | None, max_new_tokens: int | Sequence[int] = 64,
                temperature: float = 0.0, top_p: float = 1.0, seed: int = 0,
                speculative: bool = False, prefill: str = 'auto', n_win: int = 0,
                verify_cost: float | None = None, draft_len: int = 0,
                image_docs: list | None = None,
                tokens_per_dispatch: int = TOKENS_PER_DISPATCH, prefill_chunk: int = PREFILL_CHUNK,
                stream: Callable[[int, list[int]], None] | None = None) -> list[Result]:
  """Prefill the prompts as one right-padded batch, then decode until every row has its
  max_new_tokens (one for all rows, or one per row) or its end-of-document (eos_id; None: never
  stop early). Plain decoding runs up to tokens_per_dispatch steps per dispatch on the device,
  speculative decoding rounds until a row could pass max(tokens_per_dispatch, k + 1) tokens
  (1: the one-step loop, either); `stream(row, tokens)` receives each row's new tokens after
  every dispatch. Text prompts longer than prefill_chunk positions prefill that many per dispatch
  (`_chunked_prefill`; 0: whole)."""
  if not len(prompts):
    raise GenerateError('no prompts given')
  budgets = row_budgets(max_new_tokens, len(prompts))
  if tokens_per_dispatch < 1:
    raise GenerateError(f'--tokens_per_dispatch must be >= 1, got {tokens_per_dispatch}')
  if prefill_chunk < 0:
    raise GenerateError(f'--prefill_chunk must be >= 0 (0: the whole prompt at once), got '
                        f'{prefill_chunk}')
  if not 0 < top_p <= 1:
    raise GenerateError(f'--top_p must be in (0, 1], got {top_p}')
  k = cfg.dspark.block_size if speculative else 0
  k = min(k, draft_len) if draft_len else k
  verify_cost = default_verify_cost(verify_cost, tokens_per_dispatch)
  lengths = np.asarray([len(p) for p in prompts], np.int32)
  limit = max_positions(cfg)
  for i, (n, budget) in enumerate(zip(lengths, budgets)):
    if n + budget + k + 1 > limit:
      raise GenerateError(f'prompt {i}: {n} tokens + --max_new_tokens={budget} exceed '
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
  t = length_bucket(int(lengths.max()))
  spec = CacheSpec(batch=len(prompts), max_len=length_bucket(t + int(budgets.max()) + k + 1),
                   max_chunk=k + 1)
  tokens_bt = np.zeros((len(prompts), t), np.int32)
  for i, p in enumerate(prompts):
    tokens_bt[i, :len(p)] = p
  images = None if image_docs is None else \
      jax.tree.map(jnp.asarray, image_fields(cfg, image_docs, t))
  key = jax.random.key(seed)
  feature_dim = cfg.model.d_model if speculative else 0
  cache = empty_cache(progs.model, spec, feature_dim)
  t0 = time.perf_counter()
  win = min(n_win or exact_n_win(cfg), t)
  if prefill_chunk and t > prefill_chunk and images is None:
    logits_last, cache = _chunked_prefill(progs, cache, tokens_bt, lengths, prefill_chunk,
                                          win if prefill == 'ced' else 0, speculative,
                                          cfg.model.vocab_size)
  elif prefill == 'ced':
    logits_last, cache = progs.prefill_ced(cache, jnp.asarray(tokens_bt), jnp.asarray(lengths),
                                           win, speculative, images)
  else:
    logits_last, cache = progs.prefill_full(cache, jnp.asarray(tokens_bt),
                                            jnp.asarray(lengths), speculative, images)
  key, sub = jax.random.split(key)
  nxt = sampling.sample(sub, logits_last, temperature, top_p)[0]
  nxt = np.asarray(nxt)
  prefill_s = time.perf_counter() - t0

  rows = Rows(budgets, eos_id)
  rows.add([[int(x)] for x in nxt])
  rows.publish(stream)
  sampler = dict(temperature=temperature, top_p=top_p)
  if tokens_per_dispatch == 1:
    decode_s, forwards, untimed, accepted = _one_step_loop(
        progs, cache, rows, nxt, key, stream, speculative=speculative, k=k,
        verify_cost=verify_cost, **sampler)
  elif speculative:
    decode_s, forwards, untimed, accepted = _speculative_loop(
        progs, cache, rows, nxt, key, stream, eos_id=eos_id, k=k, verify_cost=verify_cost,
        n=max(tokens_per_dispatch, k + 1), **sampler)
  else:
    decode_s, forwards, untimed = _device_loop(progs, cache, rows, nxt, key, stream,
                                               eos_id=eos_id, n=tokens_per_dispatch, **sampler)
    accepted = np.zeros(len(prompts), np.int64)
  timed = rows.counts() - untimed
  return [Result(prompt_tokens=[int(x) for x in p], tokens=rows.tokens[i], text='',
                 prefill_s=prefill_s, decode_s=decode_s, forwards=forwards,
                 accepted_drafts=int(accepted[i]), timed_tokens=int(max(0, timed[i])))
          for i, p in enumerate(prompts)]


def _chunked_prefill(progs: Programs, cache, tokens_bt: np.ndarray, lengths: np.ndarray,
                     chunk: int, n_win: int, features: bool, vocab: int):
  """Prefill `chunk` prompt positions per dispatch: every layer over each chunk (n_win = 0), or
  CED's encoder over each chunk and then its decoder over the last n_win positions. The same
  cache and last logits as the whole prompt in one dispatch, at one chunk's activations."""
  b, t = tokens_bt.shape
  padded = np.zeros((b, -(-t // chunk) * chunk), np.int32)
  padded[:, :t] = tokens_bt
  lengths_b = jnp.asarray(lengths)
  if n_win:
    tail = progs.tail_buffers(b, n_win, features)
    for s in range(0, padded.shape[1], chunk):
      cache, tail = progs.prefill_ced_chunk(cache, jnp.asarray(padded[:, s:s + chunk]),
                                            lengths_b, tail, features)
    return progs.prefill_ced_tail(cache, tail, lengths_b, features)
  last_bv = jnp.zeros((b, vocab), jnp.float32)
  for s in range(0, padded.shape[1], chunk):
    last_bv, cache = progs.prefill_full_chunk(cache, jnp.asarray(padded[:, s:s + chunk]),
                                              lengths_b, last_bv, features)
  return last_bv, cache


def _one_step_loop(progs: Programs, cache, rows: Rows, nxt, key, stream, *, temperature,
                   top_p, speculative: bool, k: int, verify_cost: float):
  """One dispatch and host round trip per forward: a plain step, or a draft and its
  verification. (decode_s, forwards, tokens per row before the timed part, accepted drafts)."""
  b = len(rows.budgets)
  forwards, accepted = 0, np.zeros(b, np.int64)
  decode_s, first = 0.0, True
  untimed = rows.counts()
  while not rows.done.all():
    t1 = time.perf_counter()
    key, sub = jax.random.split(key)
    if speculative:
      key, dkey = jax.random.split(key)
      drafts, q, conf = progs.draft(cache, jnp.asarray(nxt), dkey, temperature, top_p, k)
      admit = np.array(sampling.verify_length(conf, verify_cost))
      admit[rows.done] = 0
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
      emitted = [list(d[i, :acc[i]]) + [int(nxt_host[i])] for i in range(b)]
      accepted += np.where(rows.done, 0, acc)
    nxt = np.asarray(nxt_dev)
    forwards += 1
    rows.add(emitted)
    if first:  # the first step compiles: timed from the second on
      first = False
      untimed = rows.counts()
    else:
      decode_s += time.perf_counter() - t1
    rows.publish(stream)
  return decode_s, forwards, untimed, accepted


def _device_carry(cache, nxt, key, rows: Rows) -> dict:
  """What a device loop's dispatches carry: the cache (donated), each row's last token, the key,
  its done flag and remaining budget."""
  return {'cache': cache, 'last': jnp.asarray(nxt), 'key': key, 'done': jnp.asarray(rows.done),
          'left': jnp.asarray(rows.budgets - rows.counts(), jnp.int32)}


def _drive(rows: Rows, stream, dispatch) -> tuple[float, int, np.ndarray]:
  """Call `dispatch(first)` -> (tokens [B, n], emitted [B], done [B], forwards it ran) until every
  row is done, each dispatch's tokens added and streamed once. The first dispatch (it compiles)
  is untimed, as the one-step loop's first. (decode_s, forwards, tokens per row before the
  timed part)."""
  forwards, decode_s, untimed = 0, 0.0, None
  while not rows.done.all():
    t1 = time.perf_counter()
    tokens_bn, count_b, done_b, ran = dispatch(untimed is None)
    forwards += int(ran)
    rows.add([tokens_bn[i, :count_b[i]] for i in range(len(count_b))], finished=done_b)
    if untimed is None:
      untimed = rows.counts()
    else:
      decode_s += time.perf_counter() - t1
    rows.publish(stream)
  return decode_s, forwards, rows.counts() if untimed is None else untimed


def _device_loop(progs: Programs, cache, rows: Rows, nxt, key, stream, *, eos_id,
                 temperature, top_p, n: int):
  """Plain decoding, up to n steps per dispatch (`Programs.decode_steps`); the host sees each
  dispatch's tokens once. The first dispatch runs one step; the keys split as the one-step
  loop splits them, step by step. (decode_s, forwards, tokens per row before the timed part)."""
  carry = _device_carry(cache, nxt, key, rows)
  eos = jnp.int32(NO_TOKEN if eos_id is None else eos_id)

  def dispatch(first):
    nonlocal carry
    out, carry = progs.decode_steps(carry, eos, jnp.int32(1 if first else n), temperature,
                                    top_p, n)
    return jax.device_get((out['tokens'], out['count'], carry['done'], out['steps']))
  return _drive(rows, stream, dispatch)


def _speculative_loop(progs: Programs, cache, rows: Rows, nxt, key, stream, *, eos_id,
                      temperature, top_p, k: int, n: int, verify_cost: float):
  """Speculative decoding, rounds on the device (`Programs.speculate`) until a row could
  outgrow its n tokens of one dispatch: the row furthest ahead brings back n - k to n tokens
  per dispatch, the host sees them once. The first dispatch runs one round. (decode_s,
  forwards, tokens per row before the timed part, accepted drafts per row)."""
  carry = _device_carry(cache, nxt, key, rows)
  eos = jnp.int32(NO_TOKEN if eos_id is None else eos_id)
  cost = jnp.float32(verify_cost)
  accepted = np.zeros(len(rows.budgets), np.int64)

  def dispatch(first):
    nonlocal carry, accepted
    out, carry = progs.speculate(carry, eos, jnp.int32(1 if first else n), cost, temperature,
                                 top_p, k, n)
    tokens_bn, count_b, done_b, ran, acc_b = jax.device_get(
        (out['tokens'], out['count'], carry['done'], out['rounds'], out['accepted']))
    accepted = accepted + acc_b
    return tokens_bn, count_b, done_b, ran
  return (*_drive(rows, stream, dispatch), accepted)


