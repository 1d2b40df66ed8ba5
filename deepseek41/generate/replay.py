"""Bounded replay measured: how far the next-token distribution moves when the SWA windows are
dropped and rebuilt from the last n_win tokens (docs/architecture.md section 3.10).

    python -m deepseek41.generate.replay --workdir=runs/1b --context=2048 --n_win=128,512

Held-out text (the run's held-out split) is cut into sequences of `--context` tokens inside one
document; each is prefilled exactly, then its windows are dropped and replayed over the last
n_win tokens (the compressed entries stay as stored), and KL(exact || replayed) of the
distribution of the next token is averaged over the sequences. n_win >= num_layers x
(sliding_window - 1) + 1 rebuilds every window exactly (KL 0 up to rounding).
"""

from __future__ import annotations

import dataclasses
import json
import sys

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags
from flax import nnx

from deepseek41.data.pipeline import make_dataset
from deepseek41.generate.cache import empty_cache
from deepseek41.generate.decode import forward_chunk, replay_windows
from deepseek41.generate.generator import GenerateError, Generator
from deepseek41.model.layer_cache import CacheSpec


def exact_replay_window(m) -> int:
  """The shortest replay that rebuilds every window exactly."""
  return m.num_layers * (m.sliding_window - 1) + 1


def next_token_kl(model, cfg, tokens_nl: np.ndarray, n_wins, *, batch: int = 8,
                  engram_map=None) -> dict[int, dict[str, float]]:
  """{n_win: {'mean_kl', 'max_kl', 'top1_agree'}} over the rows of tokens_nl [N, L] (nats)."""
  n, length = tokens_nl.shape
  spec = CacheSpec(batch=batch, max_len=length, max_chunk=1)

  graph, state = nnx.split(model)

  @jax.jit
  def exact_fn(state, tokens):
    mdl = nnx.merge(graph, state)
    logits, _, cache = forward_chunk(mdl, empty_cache(mdl, spec), tokens,
                                     jnp.ones(tokens.shape, bool), engram_map=engram_map)
    return jax.nn.log_softmax(logits[:, -1]), cache

  replays = {}
  for w in n_wins:
    if not 0 < w <= length:
      raise ValueError(f'--n_win={w} must be in [1, --context={length}]')
    replays[w] = jax.jit(lambda state, cache, w=w: jax.nn.log_softmax(
        replay_windows(nnx.merge(graph, state), cache, w, engram_map=engram_map)[0][:, -1]))

  kls = {w: [] for w in n_wins}
  agree = {w: [] for w in n_wins}
  for start in range(0, n - batch + 1, batch):  # whole batches only (one compiled shape)
    rows = jnp.asarray(tokens_nl[start:start + batch])
    logp, cache = exact_fn(state, rows)
    for w in n_wins:
      logq = replays[w](state, cache)
      kls[w] += np.asarray(jnp.sum(jnp.exp(logp) * (logp - logq), axis=-1)).tolist()
      agree[w] += np.asarray(jnp.argmax(logp, -1) == jnp.argmax(logq, -1)).tolist()
  return {w: {'mean_kl': float(np.mean(kls[w])), 'max_kl': float(np.max(kls[w])),
              'top1_agree': float(np.mean(agree[w])), 'sequences': len(kls[w])}
          for w in n_wins if kls[w]}


def held_out_sequences(data_cfg, tokenizer, context: int, count: int) -> np.ndarray:
  """[count, context] token ids from the run's held-out split, each inside one document."""
  del tokenizer  # the split is already tokenized with it
  data = dataclasses.replace(data_cfg, num_workers=0, seq_len=context)
  ds = make_dataset(data, split='heldout', batch_size=8, seed=0, process_index=0,
                    process_count=1, repeat=False, shuffle=False, kinds=('text',))
  out = []
  for local in ds:
    seg, tok = np.asarray(local['segment_ids']), np.asarray(local['tokens'])
    for r in range(seg.shape[0]):
      if seg[r, 0] > 0 and (seg[r] == seg[r, 0]).all():
        out.append(tok[r])
      if len(out) == count:
        return np.stack(out)
  if not out:
    raise GenerateError(f'the held-out split has no document of {context} tokens; lower --context')
  return np.stack(out)


def _define_flags():  # only when run as a program: importers keep their own flags
  return {
      'workdir': flags.DEFINE_string('workdir', None, 'Work directory of a training run.'),
      'step': flags.DEFINE_integer('step', None, 'Checkpoint step (default: the newest).'),
      'context': flags.DEFINE_integer('context', 1024, 'Tokens per held-out sequence.'),
      'n_win': flags.DEFINE_list('n_win', ['128', '512'], 'Replay lengths.'),
      'sequences': flags.DEFINE_integer('sequences', 32, 'Held-out sequences (a multiple of 8).'),
  }


def main(f):
  try:
    gen = Generator(f['workdir'].value, f['step'].value)
    tokens = held_out_sequences(gen.data_cfg, gen.tokenizer, f['context'].value,
                                f['sequences'].value)
    wins = [int(w) for w in f['n_win'].value]
    with jax.set_mesh(gen.mesh):
      result = next_token_kl(gen.model, gen.cfg, tokens, wins, engram_map=gen.engram_map)
  except (GenerateError, ValueError) as e:
    print(f'error: {e}', file=sys.stderr)
    return 2
  print(json.dumps({'step': gen.step, 'context': f['context'].value,
                    'exact_n_win': exact_replay_window(gen.cfg.model),
                    **{f'n_win={w}': r for w, r in result.items()}}))
  return 0


if __name__ == '__main__':
  _FLAGS = _define_flags()
  app.run(lambda argv: sys.exit(main(_FLAGS)))
